"""fedge bench mqtt: the reliable channel vs raw paho on loopback Mosquitto, and on a flaky link.

Part 1 (loopback): one 100 MB message through the channel (256 KiB chunks, window 16) vs the same bytes
published raw with paho as 1 MiB QoS 1 messages (both with TCP_NODELAY, like the channel). Time runs from the
publisher's start to the last byte at the receiver; the publisher runs in its own process so its CPU seconds
(user + system, all threads) are its alone.
Headline: ``throughput_vs_raw`` (raw time / channel time, goal >= 0.8), ``publisher_cpu_s_100mb`` (< 0.5).

Part 2 (flaky): the coordinator reaches the broker through the lossy-link proxy (20 MB/s, 50 ms each way,
connection resets every 4 s on average); a 60 MB message is sent 10 times. Headline: ``flaky_completed`` of
``flaky_runs``, ``flaky_time_over_ideal`` (mean time / (bytes / link rate), goal <= 2) and
``resent_bytes_per_disconnect_over_window`` (bytes the publisher sent beyond a clean run, per reset, over one
window of chunks; goal <= 1). Re-sent bytes are counted by the proxy, so paho's own re-sends count too.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time

from fedge.bench._common import emit, parse_args
from fedge.localnet import LinkProfile, LossyLinkProxy, MosquittoBroker
from fedge.transport import CoordinatorEndpoint, MqttConfig, NodeEndpoint, TransferSettings

MB = 1_000_000
RAW_MESSAGE = 1024 * 1024
FLEET = "bench"


def _publish_channel(url: str, size: int, pipe: mp.connection.Connection) -> None:
    """Child process: send ``size`` bytes to node n1 through the channel; report CPU and wall seconds."""
    payload = os.urandom(size)
    with CoordinatorEndpoint(MqttConfig(broker_url=url, fleet=FLEET)) as coordinator:
        pipe.send("ready")
        pipe.recv()
        cpu, wall = time.process_time(), time.perf_counter()
        delivered = coordinator.send("n1", payload).wait(120)
        pipe.send((delivered, time.process_time() - cpu, time.perf_counter() - wall))


def _publish_raw(url: str, size: int, pipe: mp.connection.Connection) -> None:
    """Child process: publish ``size`` bytes as 1 MiB QoS 1 messages with plain paho; report CPU and wall."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    payload = memoryview(os.urandom(size))
    host, port = url.removeprefix("mqtt://").split(":")
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="bench-raw-pub", protocol=paho.MQTTv5)
    client.on_socket_open = _no_delay
    client.connect(host, int(port))
    client.loop_start()
    pipe.send("ready")
    pipe.recv()
    cpu, wall = time.process_time(), time.perf_counter()
    infos = [
        client.publish("bench/raw", bytes(payload[i : i + RAW_MESSAGE]), qos=1)
        for i in range(0, size, RAW_MESSAGE)
    ]
    for info in infos:
        info.wait_for_publish(120)
    pipe.send((True, time.process_time() - cpu, time.perf_counter() - wall))
    client.disconnect()
    client.loop_stop()


def _no_delay(_client: object, _userdata: object, sock: socket.socket) -> None:
    """The same TCP tuning the channel uses, so the baseline is not slowed by Nagle's algorithm."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _run_publisher(target: object, url: str, size: int, done: threading.Event) -> dict[str, float]:
    """Start a publisher process, release it, and time until ``done`` (the receiver has everything)."""
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=target, args=(url, size, child))
    process.start()
    assert parent.recv() == "ready"
    start = time.perf_counter()
    parent.send("go")
    if not done.wait(180):
        raise RuntimeError("receiver did not get the whole message in 180 s")
    wall = time.perf_counter() - start
    delivered, cpu_s, _ = parent.recv()
    process.join(30)
    return {"wall_s": wall, "publisher_cpu_s": cpu_s, "delivered": delivered}


def _loopback(size: int, repeats: int) -> dict[str, dict[str, object]]:
    """Alternate raw and channel runs ``repeats`` times; report the median of each (the machine is shared)."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    runs: dict[str, list[dict[str, float]]] = {"raw": [], "channel": []}
    done = {name: threading.Event() for name in runs}
    received = [0]

    def on_raw(_c: object, _u: object, message: paho.MQTTMessage) -> None:
        received[0] += len(message.payload)
        if received[0] >= size:
            done["raw"].set()

    with MosquittoBroker() as broker:
        # Raw baseline: a plain paho subscriber counts bytes; the channel's receiver is a node endpoint.
        subscriber = paho.Client(CallbackAPIVersion.VERSION2, client_id="bench-raw-sub", protocol=paho.MQTTv5)
        subscriber.on_message, subscriber.on_socket_open = on_raw, _no_delay
        subscriber.connect("127.0.0.1", broker.port)
        subscriber.subscribe("bench/raw", qos=1)
        subscriber.loop_start()
        node_config = MqttConfig(broker_url=broker.url, fleet=FLEET)
        with NodeEndpoint(node_config, "n1", on_message=lambda _: done["channel"].set()):
            time.sleep(0.3)
            for _ in range(repeats):
                for name, publisher in (("raw", _publish_raw), ("channel", _publish_channel)):
                    received[0], done[name] = 0, threading.Event()
                    runs[name].append(_run_publisher(publisher, broker.url, size, done[name]))
        subscriber.disconnect()
        subscriber.loop_stop()
    summary: dict[str, dict[str, object]] = {}
    for name, results in runs.items():
        wall = statistics.median(r["wall_s"] for r in results)
        cpu = statistics.median(r["publisher_cpu_s"] for r in results)
        summary[name] = {
            "wall_s": wall,
            "publisher_cpu_s": cpu,
            "mb_per_s": size / MB / wall,
            "runs": results,
        }
    return summary


def _flaky(size: int, runs: int) -> dict[str, object]:
    settings = TransferSettings()
    rate = 20 * MB
    profile = LinkProfile(latency_ms=50, rate_bytes_per_s=rate, reset_mean_s=4.0, seed=7)
    payload = os.urandom(size)
    times, resent, resets, completed = [], 0, 0, 0
    with MosquittoBroker() as broker, LossyLinkProxy("127.0.0.1", broker.port, profile) as proxy:
        node_config = MqttConfig(broker_url=broker.url, fleet=FLEET, transfer=settings)
        coordinator_config = MqttConfig(broker_url=proxy.url, fleet=FLEET, transfer=settings, keepalive_s=10)
        with NodeEndpoint(node_config, "n1") as node, CoordinatorEndpoint(coordinator_config) as coordinator:
            # A clean run (no resets) gives the bytes one transfer costs on the wire.
            proxy.set_profile(reset_mean_s=None)
            up = proxy.stats.bytes_up
            coordinator.send("n1", payload).wait(120)
            clean_bytes = proxy.stats.bytes_up - up
            node.receive(5)
            proxy.set_profile(reset_mean_s=4.0)
            for _ in range(runs):
                up, reset_count = proxy.stats.bytes_up, proxy.stats.resets
                start = time.perf_counter()
                delivered = coordinator.send("n1", payload).wait(120)
                elapsed = time.perf_counter() - start
                got = node.receive(5)
                ok = delivered and got is not None and got.payload == payload
                completed += ok
                times.append(elapsed)
                run_resets = proxy.stats.resets - reset_count
                resets += run_resets
                resent += max(0, proxy.stats.bytes_up - up - clean_bytes)
    ideal = size / rate
    window_bytes = settings.window * settings.chunk_size
    return {
        "runs": runs,
        "completed": completed,
        "times_s": times,
        "ideal_s": ideal,
        "mean_time_over_ideal": statistics.mean(times) / ideal,
        "max_time_over_ideal": max(times) / ideal,
        "resets": resets,
        "resent_bytes": resent,
        "clean_run_bytes": clean_bytes,
        "resent_per_disconnect_over_window": resent / resets / window_bytes if resets else 0.0,
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    logging.basicConfig(level=logging.WARNING)
    loop_size, flaky_size, flaky_runs = (20 * MB, 12 * MB, 2) if args.quick else (100 * MB, 60 * MB, 10)
    loopback = _loopback(loop_size, repeats=3)
    flaky = _flaky(flaky_size, flaky_runs)
    raw, channel = loopback["raw"], loopback["channel"]
    rows = [
        {
            "run": f"{name} {loop_size // MB} MB",
            "wall_s": r["wall_s"],
            "MB/s": r["mb_per_s"],
            "cpu_s": r["publisher_cpu_s"],
        }
        for name, r in loopback.items()
    ]
    rows += [
        {
            "run": f"flaky {i + 1}: {flaky_size // MB} MB",
            "wall_s": t,
            "MB/s": flaky_size / MB / t,
            "cpu_s": None,
        }
        for i, t in enumerate(flaky["times_s"])
    ]
    result = {
        "loopback_bytes": loop_size,
        "loopback": loopback,
        "flaky_bytes": flaky_size,
        "flaky": flaky,
        "headline": {
            "throughput_vs_raw": raw["wall_s"] / channel["wall_s"],
            "publisher_cpu_s_100mb": channel["publisher_cpu_s"] * 100 * MB / loop_size,
            "raw_publisher_cpu_s_100mb": raw["publisher_cpu_s"] * 100 * MB / loop_size,
            "flaky_completed": flaky["completed"],
            "flaky_runs": flaky["runs"],
            "flaky_time_over_ideal": flaky["mean_time_over_ideal"],
            "flaky_resets": flaky["resets"],
            "resent_bytes_per_disconnect_over_window": flaky["resent_per_disconnect_over_window"],
        },
    }
    emit(result, as_json=args.json, title="fedge bench mqtt", rows=rows)


if __name__ == "__main__":
    main()
