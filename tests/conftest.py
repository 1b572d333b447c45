import pytest
import torch

from engine.config import tiny_config
from engine.model import Llama


@pytest.fixture(scope="session")
def tiny_model() -> Llama:
    return Llama.random_init(tiny_config(vocab_size=64), seed=0)


@pytest.fixture(scope="session")
def real_model():
    """The default target (SmolLM2-135M, fp32) and its tokenizer: loaded once per test session."""
    from engine.gguf_loader import default_model_path

    torch.manual_seed(0)
    return Llama.from_gguf(default_model_path(), dtype="fp32", device="cpu")


@pytest.fixture(scope="session")
def hf_model():
    """The independent oracle: transformers' LlamaForCausalLM reading the same GGUF (tests only)."""
    transformers = pytest.importorskip("transformers")
    from engine.gguf_loader import default_model_path

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()
