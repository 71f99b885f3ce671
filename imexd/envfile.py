"""Environment files read as systemd's `EnvironmentFile=` reads them.

`imexd config --env-file FILE` loads the settings with the variables systemd would pass
the agent, so that an operator validates what the unit will run. The rules follow
systemd's `parse_env_file_internal` (src/basic/env-file.c), character by character:

- a line whose first non-blank character is `#` or `;` is a comment; there are no
  comments after a value: `KEY=10.0.0.1  # note` sets KEY to `10.0.0.1  # note`;
- `KEY=VALUE`; blanks around the key and before the value are dropped, and trailing
  blanks of an unquoted value too;
- `'...'` keeps everything literally; `"..."` too, except that a backslash before
  `"`, `\\`, `` ` `` or `$` stands for that character, and a backslash before a newline
  joins the lines; quoted and unquoted parts of one value are joined (`A="x"y` is `xy`);
- outside quotes a backslash keeps the next character and a backslash at the end of a
  line joins the next line;
- nothing is expanded: `$OTHER` stays as it is.

What systemd skips quietly, or reads differently between versions, is a problem here,
each naming the file and line: a line without `=`, a name that is not a variable name
(`export KEY=...`: systemd drops it), invalid UTF-8 (systemd refuses the whole file), and
a comment ending in a backslash (systemd before 254 takes the next line as comment too).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from pathlib import Path

from imexd.errors import ConfigError

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
"""systemd's `env_name_is_valid`: letters, digits and `_`, not starting with a digit."""
COMMENTS = "#;"
WHITESPACE = " \t\n\r"
NEWLINE = "\n\r"
SHELL_NEED_ESCAPE = '"\\`$'


@dataclass(frozen=True, slots=True)
class Assignment:
    """One `NAME=value` of an environment file, with the line it starts on."""

    name: str
    value: str
    line: int


@dataclass(frozen=True, slots=True)
class EnvFile:
    """An environment file as systemd passes it: the assignments (a later one of a name
    wins), the problems that make it not do what it says, and warnings."""

    path: str
    assignments: tuple[Assignment, ...]
    problems: tuple[str, ...]
    warnings: tuple[str, ...]

    @property
    def environ(self) -> dict[str, str]:
        return {a.name: a.value for a in self.assignments}

    @property
    def labels(self) -> dict[str, str]:
        """Each name as problems should name it: `FILE:LINE: NAME` (of its last line)."""
        return {a.name: f"{self.path}:{a.line}: {a.name}" for a in self.assignments}


class _State(enum.Enum):
    PRE_KEY = enum.auto()
    KEY = enum.auto()
    PRE_VALUE = enum.auto()
    VALUE = enum.auto()
    VALUE_ESCAPE = enum.auto()
    SINGLE_QUOTE = enum.auto()
    DOUBLE_QUOTE = enum.auto()
    DOUBLE_QUOTE_ESCAPE = enum.auto()
    COMMENT = enum.auto()
    COMMENT_ESCAPE = enum.auto()


@dataclass(slots=True)
class _Parser:
    """The state machine of systemd's parser; `raw` records what systemd would skip."""

    path: str
    state: _State = _State.PRE_KEY
    line: int = 1
    start: int = 1
    key: str = ""
    value: str | None = None
    key_blank: int | None = None
    value_blank: int | None = None
    found: list[tuple[str, str | None, int]] = field(default_factory=list)
    """(key, value or None for `KEY=` with nothing after it, first line)."""
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """(line, the text without `=`, or a backslash for a comment that ends in one)."""

    def push(self) -> None:
        key = self.key if self.key_blank is None else self.key[: self.key_blank]
        self.found.append((key, self.value, self.start))
        self.key, self.value, self.key_blank, self.value_blank = "", None, None, None

    def add(self, c: str) -> None:
        self.value = (self.value or "") + c

    def feed(self, c: str) -> None:
        s = _State
        if c == "\n":
            self.line += 1
        match self.state:
            case s.PRE_KEY:
                if c in COMMENTS:
                    self.state = s.COMMENT
                elif c not in WHITESPACE:
                    self.state, self.key, self.key_blank = s.KEY, c, None
                    self.start = self.line
            case s.KEY:
                if c in NEWLINE:
                    self.skipped.append((self.start, self.key.strip()))
                    self.state, self.key = s.PRE_KEY, ""
                elif c == "=":
                    self.state, self.value_blank = s.PRE_VALUE, None
                else:
                    if c not in WHITESPACE:
                        self.key_blank = None
                    elif self.key_blank is None:
                        self.key_blank = len(self.key)
                    self.key += c
            case s.PRE_VALUE:
                if c in NEWLINE:
                    self.state = s.PRE_KEY
                    self.push()
                elif c == "'":
                    self.state = s.SINGLE_QUOTE
                elif c == '"':
                    self.state = s.DOUBLE_QUOTE
                elif c == "\\":
                    self.state = s.VALUE_ESCAPE
                elif c not in WHITESPACE:
                    self.state = s.VALUE
                    self.add(c)
            case s.VALUE:
                if c in NEWLINE:
                    self.state = s.PRE_KEY
                    self._chomp()
                    self.push()
                elif c == "\\":
                    self.state, self.value_blank = s.VALUE_ESCAPE, None
                else:
                    if c not in WHITESPACE:
                        self.value_blank = None
                    elif self.value_blank is None:
                        self.value_blank = len(self.value or "")
                    self.add(c)
            case s.VALUE_ESCAPE:
                self.state = s.VALUE
                if c not in NEWLINE:
                    self.add(c)
            case s.SINGLE_QUOTE:
                if c == "'":
                    self.state = s.PRE_VALUE
                else:
                    self.add(c)
            case s.DOUBLE_QUOTE:
                if c == '"':
                    self.state = s.PRE_VALUE
                elif c == "\\":
                    self.state = s.DOUBLE_QUOTE_ESCAPE
                else:
                    self.add(c)
            case s.DOUBLE_QUOTE_ESCAPE:
                self.state = s.DOUBLE_QUOTE
                if c in SHELL_NEED_ESCAPE:
                    self.add(c)
                elif c != "\n":
                    self.add("\\" + c)
            case s.COMMENT:
                if c == "\\":
                    self.state = s.COMMENT_ESCAPE
                elif c in NEWLINE:
                    self.state = s.PRE_KEY
            case s.COMMENT_ESCAPE:
                if c in NEWLINE:
                    self.skipped.append((self.line - 1, "\\"))
                    self.state = s.PRE_KEY
                else:
                    self.state = s.COMMENT

    def _chomp(self) -> None:
        if self.value is not None and self.value_blank is not None:
            self.value = self.value[: self.value_blank]

    def end(self) -> None:
        s = self.state
        if s is _State.KEY:
            self.skipped.append((self.start, self.key.strip()))
        elif s not in (_State.PRE_KEY, _State.COMMENT, _State.COMMENT_ESCAPE):
            if s is _State.VALUE:
                self._chomp()
            self.push()


def parse_env_file(text: str, path: str = "<env>") -> EnvFile:
    """Parse the text of an environment file (see the module docstring)."""
    parser = _Parser(path)
    for c in text:
        parser.feed(c)
    parser.end()
    problems: list[str] = []
    warnings: list[str] = []
    assignments: list[Assignment] = []
    for line, what in parser.skipped:
        if what == "\\":
            problems.append(
                f"{path}:{line}: a comment ends in a backslash: systemd before version 254 "
                "takes the next line as comment too, later versions do not; remove it"
            )
        else:
            problems.append(f"{path}:{line}: {what!r}: expected NAME=VALUE (systemd skips it)")
    for key, value, line in parser.found:
        if not NAME_RE.match(key):
            hint = " (no `export`)" if key.startswith("export ") else ""
            problems.append(
                f"{path}:{line}: {key!r}: not a variable name{hint}, systemd skips this assignment"
            )
            continue
        text_value = value or ""
        if re.search(r"\s[#;]", text_value):
            warnings.append(
                f"{path}:{line}: the value of {key} is {text_value!r}: systemd keeps a comment "
                "after a value as part of it; put comments on lines of their own"
            )
        assignments.append(Assignment(key, text_value, line))
    return EnvFile(path, tuple(assignments), tuple(problems), tuple(warnings))


def read_env_file(path: str) -> EnvFile:
    """Read and parse an environment file; ConfigError when it cannot be read, is not
    UTF-8 (systemd refuses such a file) or has problems."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read the environment file: {exc.strerror}"]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            [f"{path}:{line}: not UTF-8 (systemd refuses to load the whole file)"]
        ) from None
    parsed = parse_env_file(text, path)
    if parsed.problems:
        raise ConfigError(list(parsed.problems))
    return parsed
