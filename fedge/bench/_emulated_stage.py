"""A ``fedge serve`` agent whose device is ``k`` times slower than this host: for benchmarks on one machine.

``python -m fedge.bench._emulated_stage infer.toml K`` runs :class:`~fedge.inference.agent.InferenceAgent`
with every named (stage) request taking ``K`` times its real compute time: the agent sleeps the difference
after computing, so three emulated devices on one host overlap as three real ones would instead of competing
for its cores. Links are emulated separately, with :class:`~fedge.localnet.netem.LossyLinkProxy`.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from fedge.inference.agent import InferenceAgent, InferenceAgentConfig


def main() -> None:
    config_path, slowdown = sys.argv[1], float(sys.argv[2])
    agent = InferenceAgent(InferenceAgentConfig.from_toml(config_path))
    run_named = agent.server.run_named

    def slower(feeds):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        result = run_named(feeds)
        time.sleep(max(0.0, (slowdown - 1) * (time.perf_counter() - start)))
        return result

    agent.server.run_named = slower  # type: ignore[method-assign]
    sys.setswitchinterval(0.0005)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    agent.run_forever(stop)


if __name__ == "__main__":
    main()
