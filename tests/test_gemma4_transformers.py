"""Gemma 4 E2B/E4B through ple.integrations.transformers, against
transformers' own model: a tiny random checkpoint laid out as the published
ones (``Gemma4ForConditionalGeneration``, text, vision and audio towers, the
per-layer table ``model.language_model.embed_tokens_per_layer.weight``,
shared KV layers), loaded by the four classes users load it with; logits bit
for bit in float32 and bfloat16 on CPU and CUDA; ``generate`` with a chunked
prefill gives transformers' tokens with a prefetch hit for every chunk,
padded batches too; a save is whole; no table-sized tensor at load; and the
Gemma 4 variants without a per-layer table say there is nothing to serve."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4", reason="transformers has no Gemma 4")

from safetensors import safe_open  # noqa: E402
from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText,  # noqa: E402
                          Gemma4AudioConfig, Gemma4Config, Gemma4ForCausalLM,
                          Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig)

from allocations import recording  # noqa: E402
from helpers import quiet_transformers  # noqa: E402, F401 (an autouse fixture)
from helpers import assert_same_bits  # noqa: E402
from ple.integrations import families  # noqa: E402
from ple.integrations.transformers import close_tables, from_pretrained, tables  # noqa: E402

# E4B's structure at a tiny size: per-layer inputs of every layer packed in one
# table (rows of 256 values: one K-quant block), the last layers sharing the KV
# of earlier ones, sliding and full attention, a vision and an audio tower, the
# lm_head tied to embed_tokens.
TEXT = dict(vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64,
            hidden_size_per_layer_input=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_kv_shared_layers=2,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
            max_position_embeddings=256)
PLACEHOLDERS = dict(image_token_id=500, video_token_id=501, audio_token_id=502,
                    boi_token_id=503, eoi_token_id=504, boa_token_id=505, eoa_token_index=506)
TABLE = "model.language_model.embed_tokens_per_layer"  # the published checkpoints' name
TEXT_ONLY = {"key_mapping": {"^model.language_model.": "model."}}
# The classes users load the published checkpoints with, and what each needs.
CLASSES = {"Gemma4ForConditionalGeneration": (Gemma4ForConditionalGeneration, {}),
           "AutoModelForCausalLM": (AutoModelForCausalLM, {}),
           "AutoModelForImageTextToText": (AutoModelForImageTextToText, {}),
           "Gemma4ForCausalLM": (Gemma4ForCausalLM, TEXT_ONLY)}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def config(**text) -> Gemma4Config:
    return Gemma4Config(
        text_config=Gemma4TextConfig(**{**TEXT, **text}),
        vision_config=Gemma4VisionConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, head_dim=16,
                                         position_embedding_size=64),
        audio_config=Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2),
        **PLACEHOLDERS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("gemma4")
    Gemma4ForConditionalGeneration(config()).eval().save_pretrained(directory)
    with safe_open(directory / "model.safetensors", "pt") as f:
        assert f"{TABLE}.weight" in f.keys()  # noqa: SIM118
    return directory


def prompt(seed: int = 0, shape=(2, 10)) -> torch.Tensor:
    return torch.randint(3, 400, shape, generator=torch.Generator().manual_seed(seed))


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", CLASSES)
def test_logits_equal_transformers(checkpoint, name, dtype, device):
    model_class, options = CLASSES[name]
    reference = model_class.from_pretrained(checkpoint, dtype=dtype, **options).to(device)
    served = from_pretrained(model_class, checkpoint, dtype=dtype, **options).to(device)
    try:
        assert type(served) is type(reference)
        (module,) = tables(served)
        assert module.endswith("embed_tokens_per_layer")
        assert tables(served)[module].name == f"{TABLE}.weight"
        ids = prompt().to(device)
        assert_same_bits(logits(served, ids), logits(reference, ids))
        # The table counts: rows of another table give other logits.
        assert not torch.equal(logits(reference, ids), logits(
            model_class.from_pretrained(checkpoint, dtype=dtype, **options).to(device).apply(
                _zero_per_layer_table), ids))
    finally:
        close_tables(served)


def _zero_per_layer_table(module):
    if isinstance(module, torch.nn.Embedding) and module.weight.shape[1] == (
            TEXT["num_hidden_layers"] * TEXT["hidden_size_per_layer_input"]):
        with torch.no_grad():
            module.weight.zero_()


def test_the_published_layout_through_the_text_class_says_what_to_pass(checkpoint):
    """transformers loads none of the text model's weights from the
    multimodal layout into Gemma4ForCausalLM without a key mapping; ple says
    which one to pass rather than serve a table of a model left random."""
    with pytest.raises(ValueError, match=r"The checkpoint holds it as "
                                         r"'model.language_model.embed_tokens_per_layer.weight'.*"
                                         r"pass key_mapping=\{'\^model.language_model.': "
                                         r"'model.'\}"):
        from_pretrained(Gemma4ForCausalLM, checkpoint)


def test_a_text_checkpoint_loads_through_the_text_class(tmp_path):
    torch.manual_seed(1)
    Gemma4ForCausalLM(Gemma4TextConfig(**TEXT)).eval().save_pretrained(tmp_path)
    reference = Gemma4ForCausalLM.from_pretrained(tmp_path)
    served = from_pretrained(Gemma4ForCausalLM, tmp_path)
    assert list(tables(served)) == ["model.embed_tokens_per_layer"]
    assert_same_bits(logits(served, prompt()), logits(reference, prompt()))


def generate(model, ids, chunk_size, **kwargs):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, prefill_chunk_size=chunk_size,
                             return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding, chunk_size", [(None, 3), (None, 1), ("left", 4),
                                                 ("right", 3)])
@pytest.mark.parametrize("name", ["AutoModelForCausalLM", "Gemma4ForCausalLM"])
def test_generate_with_lookahead_equals_transformers(checkpoint, name, padding, chunk_size,
                                                     device):
    model_class, options = CLASSES[name]
    reference = model_class.from_pretrained(checkpoint, **options).to(device)
    served = from_pretrained(model_class, checkpoint, **options).to(device)
    ids, kwargs = prompt(2, (3, 10)), {}
    if padding is not None:
        mask = torch.ones_like(ids)
        for row, length in enumerate((10, 7, 4)):
            mask[row, slice(0, 10 - length) if padding == "left" else slice(length, None)] = 0
        ids = torch.where(mask.bool(), ids, 0)
        kwargs = {"attention_mask": mask.to(device), "pad_token_id": 0}
    want = generate(reference, ids.to(device), chunk_size, **kwargs)
    (table,) = tables(served).values()
    table.reset_stats()
    got = generate(served, ids.to(device), chunk_size, **kwargs)
    assert torch.equal(got[0], want[0])
    assert_same_bits(got[1], want[1])
    if device == "cuda":
        torch.cuda.synchronize()
    assert (table.stats()["prefetch_hits"], table.prefetched_bytes()) == (-(-10 // chunk_size), 0)


def test_placeholders_gather_the_pad_tokens_rows():
    """Gemma 4's multimodal model looks its image, video and audio
    placeholders up in the per-layer table as the pad token; the ids read
    ahead are those."""
    ids = torch.tensor([[7, 500, 501, 502, 9]])
    model = Gemma4ForConditionalGeneration(config())
    owner = model.model.language_model
    got, dim = families.GEMMA4.prompt_ids(model, owner, owner.embed_tokens_per_layer, ids, None)
    assert dim == -1 and got.tolist() == [[7, 0, 0, 0, 9]]
    assert families.family_of_module(model, owner, owner.embed_tokens_per_layer) is families.GEMMA4


@pytest.mark.parametrize("name", ["Gemma4ForConditionalGeneration", "Gemma4ForCausalLM"])
def test_a_save_is_whole(checkpoint, name, tmp_path):
    model_class, options = CLASSES[name]
    served = from_pretrained(model_class, checkpoint, **options)
    want = logits(served, prompt())
    served.save_pretrained(tmp_path / "saved")
    assert_same_bits(logits(model_class.from_pretrained(tmp_path / "saved", **options), prompt()),
                     want)
    again = from_pretrained(model_class, tmp_path / "saved", **options)
    assert_same_bits(logits(again, prompt()), want)


def test_no_table_sized_tensor_is_made_at_load(checkpoint):
    rows, cols = TEXT["vocab_size_per_layer_input"], (
        TEXT["num_hidden_layers"] * TEXT["hidden_size_per_layer_input"])
    with recording(rows * cols * 4) as made:
        served = from_pretrained(AutoModelForCausalLM, checkpoint)
    try:
        assert tables(served)
        assert [m for m in made.made if m.shape == (rows, cols)] == []
    finally:
        close_tables(served)
    with recording(rows * cols * 4) as made:
        AutoModelForCausalLM.from_pretrained(checkpoint)
    assert [m for m in made.made if m.shape == (rows, cols)]  # the recording sees transformers'


@pytest.mark.parametrize("variant", ["no per-layer inputs", "unified"])
def test_variants_without_a_per_layer_table_have_nothing_to_serve(variant, tmp_path, caplog):
    """Gemma 4's larger variants have no per-layer inputs
    (hidden_size_per_layer_input 0), nor does Gemma 4 unified: "auto" serves
    nothing, and says so."""
    torch.manual_seed(0)
    if variant == "unified":
        from transformers import Gemma4UnifiedForCausalLM, Gemma4UnifiedTextConfig

        fields = {k: v for k, v in TEXT.items()
                  if k not in ("vocab_size_per_layer_input", "hidden_size_per_layer_input",
                               "num_kv_shared_layers")}
        model_class, model = Gemma4UnifiedForCausalLM, Gemma4UnifiedForCausalLM(
            Gemma4UnifiedTextConfig(**fields))
    else:
        model_class = Gemma4ForCausalLM
        model = Gemma4ForCausalLM(Gemma4TextConfig(**{**TEXT, "hidden_size_per_layer_input": 0}))
    model.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ple.integrations.transformers"):
        served = from_pretrained(model_class, tmp_path)
    assert tables(served) == {}
    assert (f"ple: {model_class.__name__} has no table that offload='auto' serves"
            in caplog.text)
    assert_same_bits(logits(served, prompt()), logits(model_class.from_pretrained(tmp_path),
                                                      prompt()))


@pytest.mark.parametrize("qtype", ["q5_k", "q8_0"])
def test_a_quantized_copy_of_the_table_serves_in_its_place(checkpoint, qtype, tmp_path):
    """ple-quantize-table writes the table as a GGUF tensor; from_pretrained
    gathers from it (table_file=): logits equal to transformers' model with
    the dequantized table in the table's place, the packed rows read; the
    state dict keeps the checkpoint's own table (a save is the original)."""
    import gguf

    from ple_tools import quantize_table

    copy = tmp_path / f"table-{qtype}.gguf"
    assert quantize_table.main([str(checkpoint), str(copy), "--type", qtype]) == 0
    reader = gguf.GGUFReader(copy)
    (tensor,) = reader.tensors
    assert tensor.name == "per_layer_token_embd.weight"
    dequantized = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
    for dtype in (torch.float32, torch.bfloat16):
        served = from_pretrained(AutoModelForCausalLM, checkpoint, dtype=dtype, table_file=copy)
        reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
        per_layer = reference.model.language_model.embed_tokens_per_layer
        with torch.no_grad():
            per_layer.weight.copy_(dequantized.reshape(per_layer.weight.shape).to(dtype))
        (table,) = tables(served).values()
        assert table.format == qtype and table.paths == [copy.resolve()]
        table.reset_stats()
        ids = prompt()
        assert_same_bits(logits(served, ids), logits(reference, ids))
        stats = table.stats()
        assert stats["bytes_copied"] == ids.numel() * table.row_bytes  # packed rows, not values
        state = served.state_dict()[f"{TABLE}.weight"]
        with safe_open(checkpoint / "model.safetensors", "pt") as f:
            assert_same_bits(state, f.get_tensor(f"{TABLE}.weight"))
        close_tables(served)


def test_a_table_file_of_another_shape_is_refused(checkpoint, tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "ple")
    writer.add_tensor("per_layer_token_embd.weight", torch.zeros(8, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'per_layer_token_embd.weight' has 8 rows of 32, but "
                                         r"the table it stands for"):
        from_pretrained(AutoModelForCausalLM, checkpoint, table_file=tmp_path / "other.gguf")
