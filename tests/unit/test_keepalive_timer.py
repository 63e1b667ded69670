"""The keep-alive timer of a stream (`middleware.upstream.reader._KeepaliveTimer`): one handle
across reads, re-checked when it fires, so arming per read costs a flag (issue 21).

Deadlines with generous bounds (interval 1 s; checks 0.3 s or more from each due time)."""

from __future__ import annotations

import asyncio

from middleware.upstream.reader import _KeepaliveTimer


def _run(scenario: str) -> list[float]:
    """Beat times (seconds from the start) of one scenario."""

    async def go() -> list[float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        sent = [start]
        beats: list[float] = []

        async def keepalive() -> None:
            beats.append(loop.time() - start)
            sent[0] = loop.time()

        timer = _KeepaliveTimer(keepalive, 1.0, lambda: sent[0])
        timer.arm()
        if scenario == "heard at 0.5 s":
            await asyncio.sleep(0.5)
            sent[0] = loop.time()  # the client heard an event: the quiet time starts again
            await asyncio.sleep(0.8)
            assert beats == []  # 1.3 s from the start, 0.8 s of quiet
            await asyncio.sleep(0.6)
        elif scenario == "disarmed":
            await asyncio.sleep(0.2)
            await timer.disarm()
            await asyncio.sleep(1.3)  # past the due time, disarmed: nothing
            timer.arm()
            await asyncio.sleep(0.3)  # re-armed past the due time: it fires soon
        else:
            await asyncio.sleep(2.4)
        timer.cancel()
        return beats

    return asyncio.run(go())


def test_a_quiet_client_hears_a_keepalive_each_interval() -> None:
    beats = _run("quiet")
    assert len(beats) == 2
    assert 1.0 <= beats[0] < 1.3 and 2.0 <= beats[1] < 2.4


def test_an_event_sent_between_puts_the_keepalive_off_by_a_whole_interval() -> None:
    beats = _run("heard at 0.5 s")
    assert len(beats) == 1
    assert 1.5 <= beats[0] < 1.9


def test_no_keepalive_goes_out_while_disarmed() -> None:
    beats = _run("disarmed")
    assert len(beats) == 1
    assert 1.5 <= beats[0] < 1.8  # at the re-arming (1.5 s), not at the due time (1.0 s)
