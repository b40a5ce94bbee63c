"""Loaders: HF directory round trip, GGUF conversion cache, clear errors for bad paths."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from safetensors.torch import save_file

from kvserve.attention import StepAttention, StepMetadata
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.cache.kv_pool import KVPool
from kvserve.model.ops import EagerOps
from kvserve.model.config import ModelConfig
from kvserve.model.gguf_convert import convert_gguf, publish
from kvserve.model.loader import default_model_path, hf_state_dict, load_model, load_tokenizer

CPU = torch.device("cpu")


def logits(model: torch.nn.Module, cfg: ModelConfig, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    blocks = -(-n // 16)
    pool = KVPool(cfg.num_layers, blocks, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU)
    step = StepMetadata.build([n], [n], [list(range(blocks))], 16, CPU)
    attention = StepAttention.of(TorchSDPABackend(pool, cfg.num_heads), step)
    with torch.inference_mode():
        return model(torch.tensor(ids), attention, torch.arange(n), EagerOps())


@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)])
def test_hf_directory_round_trip(tmp_path: Path, tied: bool, bias: bool) -> None:
    cfg = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=1, head_dim=8, max_position=64, tie_word_embeddings=tied, qkv_bias=bias)
    original = load_model(cfg, torch.float32, CPU, seed=3)
    state = hf_state_dict(original.model)
    assert "model.layers.0.self_attn.k_proj.weight" in state and ("lm_head.weight" in state) != tied
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    loaded = load_model(tmp_path, torch.float32, CPU)
    assert loaded.config == cfg
    ids = [3, 14, 15, 92, 65, 35]
    assert torch.equal(logits(loaded.model, cfg, ids), logits(original.model, cfg, ids))
    if tied:
        assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()


def test_missing_and_wrong_paths_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_model(tmp_path / "nope.gguf", torch.float32, CPU)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a .gguf"):
        load_model(tmp_path / "weights.bin", torch.float32, CPU)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, torch.float32, CPU)
    with pytest.raises(ValueError, match="unknown preset"):
        load_model("random:nope", torch.float32, CPU)


@pytest.mark.model
def test_gguf_conversion_is_cached() -> None:
    first = convert_gguf(default_model_path())  # the shared cache, converted once per machine
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(default_model_path()) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    cfg = json.loads((first / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rope_theta"]) == (9, 3, 100000.0)
    assert cfg["tie_word_embeddings"] is True
    assert (first / "tokenizer.json").exists()


@pytest.mark.model
def test_the_tokenizer_loads_as_autotokenizer_would() -> None:
    """The direct load skips AutoTokenizer's class lookup; the tokenizer must be the same."""
    from transformers import AutoTokenizer
    directory = convert_gguf(default_model_path())
    ours, auto = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert type(ours) is type(auto)
    texts = ["The capital of France is", "  def f(x):\n\treturn x ** 2  ", "naïve café 東京 🙂",
             "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert ours(text).input_ids == auto(text).input_ids
        assert ours.decode(auto(text).input_ids) == auto.decode(auto(text).input_ids)
    chat = [{"role": "user", "content": "Hello"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert (ours.all_special_ids, ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        auto.all_special_ids, auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)


def test_a_damaged_tokenizer_config_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    assert load_tokenizer(tmp_path) is None


def test_a_published_directory_appears_whole_and_the_first_one_stays(tmp_path: Path) -> None:
    out = tmp_path / "cache" / "converted"

    def write(text: str) -> Callable[[Path], None]:
        def fill(tmp: Path) -> None:
            (tmp / "config.json").write_text(text)
        return fill

    def fail(tmp: Path) -> None:
        (tmp / "config.json").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publish(out, fail)
    assert not out.exists() and [p.name for p in out.parent.iterdir()] == []  # no half directory, no debris
    assert publish(out, write("first")) == out
    assert publish(out, write("second")) == out  # a process that lost the race keeps the winner's
    assert (out / "config.json").read_text() == "first" and [p.name for p in out.parent.iterdir()] == ["converted"]


def test_a_random_model_draws_its_matrices_at_the_initializer_range() -> None:
    cfg = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, initializer_range=0.2)
    model = load_model(cfg, torch.float32, CPU, seed=0).model
    stds = [p.std().item() for p in model.parameters() if p.dim() > 1]
    assert all(0.19 < s < 0.21 for s in stds), stds
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(ValueError, match="ModelConfig.initializer_range"):
        ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=16, initializer_range=0)


def test_random_presets_with_fewer_layers() -> None:
    # Mistral-7B's GQA shapes with a quarter of Llama-3-8B's vocabulary: the 1B random
    # embedding and head weights of the latter took 20 s of the suite to initialise.
    loaded = load_model("random:mistral-7b:1", torch.bfloat16, CPU)
    cfg = loaded.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (1, 32, 8, 128)
    assert len(loaded.model.model.layers) == 1 and loaded.tokenizer is None
    with pytest.raises(ValueError, match="number of layers"):
        load_model("random:llama-2-7b:x", torch.float32, CPU)


def test_damaged_model_files_name_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once: IndexError, KeyError or JSONDecodeError with no file named, and a server traceback."""
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"broken\.gguf is not a readable GGUF file"):
        load_model(gguf, torch.float32, CPU)
    cfg = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=1, head_dim=8, max_position=64)
    save_file(hf_state_dict(load_model(cfg, torch.float32, CPU).model), tmp_path / "model.safetensors")
    config = tmp_path / "config.json"
    for text in ("{not json", json.dumps({"hidden_size": 32})):
        config.write_text(text)
        with pytest.raises(ValueError, match=r"config\.json is not a valid model config"):
            load_model(tmp_path, torch.float32, CPU)
    config.write_text(json.dumps(cfg.to_hf_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        load_model(tmp_path, torch.float32, CPU)


def test_model_path_resolves_what_every_command_takes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine, eval and bench find a model the same way: the bundled one for None, a named
    model's GGUF (unless a file of that name exists), and an error naming the word otherwise."""
    from kvserve.model import loader
    assert loader.model_path(None) == default_model_path()
    monkeypatch.setattr(loader, "named_model_path", lambda name: tmp_path / f"{name}.gguf")
    assert loader.model_path("gemma3-270m") == tmp_path / "gemma3-270m.gguf"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    assert loader.model_path("gemma3-270m") == Path("gemma3-270m")
    with pytest.raises(FileNotFoundError, match="nor a model name"):
        loader.model_path("gemma4")
