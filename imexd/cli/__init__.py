"""The `imexd` command line: what the operator types, and nothing the agent runs.

- `main`: the parser of every subcommand, signal handling and exit codes (`main()` is
  the `imexd` entry point); each command imports what it needs only when it runs, so
  that `--version`, `--help` and a usage error start at once;
- `args`: what the subcommands' arguments share (types, common options, exit codes in
  each help, one-line usage errors);
- `deferred`: modules a command loads at their first use (no argparse: the agent's
  `imexd run` builds no parser);
- `control`: the control plane's subcommands (`imexd domain`, `node`, `workload`, `gc`),
  whose work is in `imexd.control`;
- `query`: asks a running agent over HTTP (`imexd check`, `imexd status`).

The top of the layers: it may import anything of imexd, and nothing imports it.
"""
