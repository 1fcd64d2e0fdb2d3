"""`AsyncVllmEngine.close` on a clean exit: vLLM's `AsyncLLM.shutdown` stops the engine core
before it cancels its output task, which then logs the dead engine as an ERROR with a traceback
(seen at the end of `mpic bench online`, about one exit in two); close drops that one record
and nothing else. No vLLM engine is started: the engine's vLLM object is a stand-in whose
shutdown logs as vLLM's does."""

import asyncio
import logging
import threading

from mpic.engine.vllm.async_engine import AsyncVllmEngine

VLLM_LOGGER = "vllm.v1.engine.async_llm"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _ShutdownLikeVllm:
    def shutdown(self) -> None:
        log = logging.getLogger(VLLM_LOGGER)
        log.error("AsyncLLM output_handler failed.")  # the dead engine, on a clean exit
        log.error("another failure")  # anything else still shows


def test_close_drops_only_the_dead_engine_record_of_a_clean_exit():
    engine = object.__new__(AsyncVllmEngine)
    engine.llm = _ShutdownLikeVllm()
    engine._loop = asyncio.new_event_loop()
    engine._thread = threading.Thread(target=engine._loop.run_forever, daemon=True)
    engine._thread.start()
    records = _Records()
    log = logging.getLogger(VLLM_LOGGER)
    log.addHandler(records)
    try:
        engine.close()
        assert not engine._thread.is_alive()
        assert records.messages == ["another failure"]
        log.error("AsyncLLM output_handler failed.")  # after close: shown again
        assert records.messages[-1] == "AsyncLLM output_handler failed."
    finally:
        log.removeHandler(records)
        engine._loop.close()
