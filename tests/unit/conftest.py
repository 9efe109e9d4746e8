"""Fixtures shared by the vLLM integration's unit tests."""

import logging

import pytest


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.messages)


@pytest.fixture
def mk_log():
    """Messages logged to "vllm.megakernel" (vLLM's own logging setup stops them reaching the root,
    so caplog would miss them where vLLM is installed). The integration logs each reason once per
    process (vllm_model._LOGGED): that memory starts empty in every test that reads the log, so what a
    test expects to see logged does not depend on which tests ran before it."""
    from megakernel.integrations import vllm_model
    vllm_model._LOGGED.clear()
    log = logging.getLogger("vllm.megakernel")
    handler, old = _Collect(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield handler
    log.setLevel(old)
    log.removeHandler(handler)
