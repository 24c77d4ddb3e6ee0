"""agentd.lab.svcecho's Echo, the test and bench side of the helper, with a made-up process: a
request the helper does not answer in time, or a helper that is gone, is a LabError (the
benches' run_main prints it as one line; a TimeoutError was a traceback), and the helper is
stopped then, so that its late answer is never read as the next request's."""

from __future__ import annotations

import asyncio

import pytest

from agentd.lab.errors import LabError
from agentd.lab.svcecho import Echo


class _Stdin:
    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.lines.append(data)

    async def drain(self) -> None:
        pass


class _Proc:
    """A helper that answers only what ``answers`` holds, in order; then stays silent."""

    def __init__(self, answers: list[bytes]) -> None:
        self.stdin = _Stdin()
        self.stdout = asyncio.StreamReader()
        for a in answers:
            self.stdout.feed_data(a)
        self.returncode: int | None = None
        self.killed = False

    def kill(self) -> None:
        self.killed = True
        self.returncode = -9

    async def wait(self) -> int | None:
        return self.returncode


def test_a_request_not_answered_in_time_stops_the_helper():
    async def main() -> tuple[_Proc, LabError, LabError]:
        proc = _Proc([])
        echo = Echo(proc)  # type: ignore[arg-type]
        with pytest.raises(LabError) as first:
            await echo.call({"crr": ["10.244.1.2", 8080], "seconds": 1}, timeout=0.01)
        proc.stdout.feed_data(b'{"connections": 10, "failed": 0, "seconds": 1.0}\n')  # the late answer
        with pytest.raises(LabError) as second:
            await echo.call({"tcp": ["10.244.1.2", 8080]})
        return proc, first.value, second.value

    proc, first, second = asyncio.run(main())
    assert proc.killed
    assert str(first) == "svcecho: no answer to a crr request within 0.01 s; the helper is stopped"
    assert "no tcp request: the helper was stopped" in str(second)
    assert len(proc.stdin.lines) == 1  # the second request was not sent to be answered by the first's reply


def test_a_helper_that_exited_is_a_lab_error():
    async def main() -> _Proc:
        proc = _Proc([])
        proc.stdout.feed_eof()
        with pytest.raises(LabError, match="exited without answering a udp request"):
            await Echo(proc).call({"udp": ["10.244.1.2", 53], "sport": 4000})  # type: ignore[arg-type]
        return proc

    assert asyncio.run(main()).killed


def test_an_answer_in_time_is_returned():
    async def main() -> dict:
        return await Echo(_Proc([b'{"name": "server"}\n'])).call({"ask": "a"})  # type: ignore[arg-type]

    assert asyncio.run(main()) == {"name": "server"}
