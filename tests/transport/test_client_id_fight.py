"""Two live clients with one client id: the fight is reported once and slowed, not left to spin."""

from __future__ import annotations

import logging

from waiting import wait_until

from fedge.transport import MqttConfig
from fedge.transport.connection import MqttConnection
from fedge.transport.flapping import FLAPS_TO_REPORT, SHORT_LIVED_S, FlapGuard


def test_the_guard_reports_a_streak_once_and_backs_off_until_a_connection_lasts():
    guard = FlapGuard(min_delay_s=0.1, max_delay_s=5.0)
    reports = []
    now = 0.0
    for _ in range(FLAPS_TO_REPORT + 6):
        guard.connected(now)
        now += 0.05
        reports.append(guard.disconnected(now))
        now += guard.reconnect_delay_s()
    assert reports.count(True) == 1 and reports[FLAPS_TO_REPORT - 1]
    assert guard.reconnect_delay_s() == 5.0  # doubled up to the maximum
    guard.connected(now)
    assert not guard.disconnected(now + SHORT_LIVED_S + 1)  # a connection that lasted ends the streak
    assert guard.flaps == 0 and guard.reconnect_delay_s() == 0.1
    assert guard.disconnected(now + 100, taken_over=True) is False and guard.flaps == 1  # counts however long


def test_two_clients_with_one_client_id_log_the_fight_and_slow_down(mosquitto, caplog):
    config = MqttConfig(broker_url=mosquitto.url, fleet="fight", reconnect_min_s=0.05, reconnect_max_s=2.0)
    first, second = MqttConnection(config, "same-id"), MqttConnection(config, "same-id")
    with caplog.at_level(logging.ERROR, logger="fedge.transport.connection"):
        first.start()
        second.start()
        try:
            wait_until(lambda: "another live client uses this client id" in caplog.text, timeout=30)
            # once reported, each side waits longer and longer: the connects stop piling up
            streak = FLAPS_TO_REPORT + 3
            wait_until(lambda: max(first._flaps.flaps, second._flaps.flaps) >= streak, timeout=30)
            delays = [c._flaps.reconnect_delay_s() for c in (first, second)]
        finally:
            first.close()
            second.close()
    assert "same-id" in caplog.text and max(delays) >= 0.05 * 2**3
    assert caplog.text.count("another live client uses this client id") <= 4  # once a streak, not per flap
