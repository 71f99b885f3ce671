"""The agent's message bus: one resilient MQTT link, and what it tells its caller.

The modules, lowest first; import from them directly (this file imports nothing, so that
a control-plane command that needs only `mqtt` does not load the link and its logging):
- `mqtt`: the MQTT boundary, the only module that imports aiomqtt and paho (also used by
  the control plane's one-shot link, `imexd.control.link`);
- `events`: what the link tells its caller (`Connected` ... `SubscribeRefused`) and the
  Last Will it keeps; no I/O, so the pure layers (the shard) import it alone;
- `waits`, `echoes`, `subscriptions`, `check`: waiting on a link, which of our
  publications came back, which filters the broker granted or refused, and whether the
  broker's retained snapshots can be trusted at all;
- `rotation`, `records`, `pings`, `drops`: which broker next and how long to wait, our
  retained records, the sync ping's round trip, and what arrives malformed;
- `signatures`: with `[control] public_key`, the control plane's records delivered only
  when signed by its key (`imexd.signing`);
- `repairs`: what a broker that reorders or loses messages needs (NATS 2.9), engaged per
  link by the broker profile (`[bus] broker`);
- `engine`: the state of the current link and the task that keeps one (connect, replay,
  prove the snapshot, serve, reconnect);
- `link`: the `Bus` itself, what callers use: the desired state and what they may ask.

It imports the layers below it (messages, topics, settings, signing, names, retry, logs,
errors)
and nothing above: no agent, shard, health or control module.
"""
