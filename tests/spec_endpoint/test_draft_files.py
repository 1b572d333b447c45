"""serve-spec's `--drafter TARGET,draft=PATH` with a draft model file of its own (a GGUF or a Hugging Face
directory): hosted when it shares the target's tokenizer, refused at start naming both otherwise."""

from __future__ import annotations

import argparse

import pytest
import torch

from specpool.engine.method import Method
from specpool.engine.runtime.gguf_loader import model_name
from specpool.spec_endpoint import drafters as drafters_module
from specpool.spec_endpoint.drafters import DrafterSpec, LoadOptions, ModelDrafters
from specpool.spec_endpoint.server import add_arguments
from tests.engine.runtime.gguf_families import byte_vocabulary, write_gguf
from tests.engine.runtime.test_chunked_models import stand_ins
from tests.engine.runtime.test_families import hf_model

OPTIONS = LoadOptions(max_sessions=2, max_len=128, device=torch.device("cpu"), dtype="fp32")


@pytest.fixture
def target(tmp_path):
    return write_gguf(hf_model("qwen2"), tmp_path / "Qwen-tiny.gguf")


@pytest.mark.parametrize("form", ["gguf", "directory"])
def test_a_draft_file_of_the_targets_tokenizer_is_hosted(tmp_path, target, form, monkeypatch):
    # Measuring the draft's step costs takes ~20 s here and is tested elsewhere (tests/spec_endpoint/test_endpoint.py).
    monkeypatch.setattr(drafters_module, "cached_step_costs", lambda model, model_id, **_: ("costs of", model_id))
    draft = hf_model("qwen2", num_hidden_layers=1)
    if form == "gguf":
        path = write_gguf(draft, tmp_path / "draft.gguf")
    else:  # no tokenizer.json: the sizes are compared
        draft.save_pretrained(path := tmp_path / "draft")
    drafters = ModelDrafters.load(DrafterSpec.parse(f"{target},draft={path}"), OPTIONS)
    assert drafters.name == "Qwen-tiny" and Method.DRAFT_MODEL in drafters.kinds
    assert drafters.draft_costs == ("costs of", str(path))
    assert drafters.drafters[Method.DRAFT_MODEL].model.config.n_layers == 1


def test_a_draft_of_another_vocabulary_is_refused_at_start(tmp_path, target):
    tokens, _ = byte_vocabulary(256)
    other = write_gguf(hf_model("qwen2", num_hidden_layers=1), tmp_path / "other.gguf",
                       tokens=[t + "x" for t in tokens[:200]] + tokens[200:])
    with pytest.raises(ValueError, match=r"--drafter Qwen-tiny: draft .*other\.gguf \(256 tokens, 256 embedding rows\) "
                                         r"and target .*Qwen-tiny\.gguf \(256 tokens, 256 embedding rows\)"):
        ModelDrafters.load(DrafterSpec.parse(f"{target},draft={other}"), OPTIONS)
    smaller = hf_model("qwen2", num_hidden_layers=1, vocab_size=192)
    smaller.save_pretrained(tmp_path / "smaller")
    with pytest.raises(ValueError, match="differ in size"):
        ModelDrafters.load(DrafterSpec.parse(f"{target},draft={tmp_path / 'smaller'}"), OPTIONS)


def test_short_names_of_target_and_draft_resolve_where_the_flag_is_read(tmp_path, monkeypatch, capsys):
    """`--drafter qwen2.5-coder-1.5b,draft=qwen2.5-coder-0.5b`: both assembled files, hosted under the name the
    target reports for its file (the file's, not the short name); an unassembled one stops serve-spec at its
    flags, naming `make setup`."""
    paths = stand_ins(tmp_path, monkeypatch)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    [text] = parser.parse_args(["--drafter", "qwen2.5-coder-1.5b,draft=qwen2.5-coder-0.5b"]).drafter
    spec = DrafterSpec.parse(text)
    assert (str(spec.target_gguf), str(spec.draft_dir)) == (paths["qwen2.5-coder-1.5b"], paths["qwen2.5-coder-0.5b"])
    assert spec.name == model_name(paths["qwen2.5-coder-1.5b"]) == "qwen2.5-coder-1.5b-instruct-q4_k_m"
    (tmp_path / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf").unlink()
    with pytest.raises(SystemExit):
        parser.parse_args(["--drafter", "qwen2.5-coder-1.5b,draft=qwen2.5-coder-0.5b"])
    assert "argument --drafter: qwen2.5-coder-0.5b: " in capsys.readouterr().err
