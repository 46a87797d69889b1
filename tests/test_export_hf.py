"""`mfsdp export`: checkpoints saved at world size 2 exported by one process (no process group) to
Hugging Face directories whose logits, loaded by transformers, equal mfsdp's model's in fp32."""

from __future__ import annotations

import json

import pytest
import torch

from test_eval_loss import SMALL, run_trainer
from mfsdp.data import prepare
from mfsdp.data.prepare import stdlib_source

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

TRAIN = ["--train.steps", "2", "--data.local_batch", "2", "--train.eval_every", "0"]
NO_SHAPE = [a for flag, value in zip(SMALL[::2], SMALL[1::2]) if not flag.startswith("--model.")
            for a in (flag, value)]  # --model.hf takes the shape from the directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "small.tokens"
    prepare(stdlib_source(), path, glob="a*.py")
    return path


def train(world, corpus, out, *args, shape=SMALL):
    world(2).run(run_trainer, argv=[*shape, *TRAIN, "--data.path", str(corpus), "--train.out_dir", str(out),
                                    *args])
    return out


def trained_state(checkpoint, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with the checkpoint's weights, read by DCP in this process (the reference)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    model.load_state_dict(state["model"])
    return model.eval()


def assert_same_logits(reference, exported_dir, vocab: int):
    exported = transformers.AutoModelForCausalLM.from_pretrained(exported_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(tokens)
        want = getattr(want, "logits", want)
        got = exported(tokens).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return exported


def bundled_reference(checkpoint):
    from mfsdp.models.moe import build_model
    from mfsdp.train.checkpoint import CheckpointMeta
    from mfsdp.train.export import model_config_of

    cfg = model_config_of(CheckpointMeta.read(checkpoint).config)
    return trained_state(checkpoint, build_model(cfg, dtype=torch.float32)), cfg


@pytest.mark.parametrize("tied", [False, True])
def test_bundled_llama_saved_by_two_ranks_exports_in_one_process(world, corpus, tmp_path, tied):
    from mfsdp.cli import main as cli_main

    # The end-of-run export (--train.export_hf) follows --train.save_dtype: "auto", the compute dtype
    # (fp32 on CPU), untied; bf16, tied.
    out = train(world, corpus, tmp_path / "run", "--model.tie_embeddings", str(tied).lower(),
                "--train.export_hf", "true", *(["--train.save_dtype", "bf16"] if tied else []))
    checkpoint = out / "checkpoints" / "step_2"
    assert json.loads((checkpoint / "meta.json").read_text())["world_size"] == 2
    reference, cfg = bundled_reference(checkpoint)
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == ("bfloat16" if tied else "float32")
    weights = safetensors_dtypes(out / "hf" / "model.safetensors")
    assert weights == {torch.bfloat16 if tied else torch.float32}, weights
    assert json.loads((out / "hf" / "generation_config.json").read_text()) == {"eos_token_id": 256}  # bytes
    assert config["tie_word_embeddings"] is tied and config["rms_norm_eps"] == cfg.norm_eps
    # ... and the command, from the run directory, in fp32 and in shards of at most 40 kB.
    assert cli_main(["export", str(out), str(tmp_path / "hf32"), "--export.dtype", "fp32",
                     "--export.max_shard_gb", "0.00004"]) == 0
    index = json.loads((tmp_path / "hf32" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    exported = assert_same_logits(reference, tmp_path / "hf32", cfg.vocab_size)
    assert type(exported).__name__ == "LlamaForCausalLM"
    if tied:
        assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()


def test_moe_tiny_exports_as_mixtral(world, corpus, tmp_path):
    from mfsdp.models.moe import build_model
    from mfsdp.train.export import export_hf

    out = train(world, corpus, tmp_path / "run", "--model.preset", "moe-tiny")
    checkpoint = out / "checkpoints" / "step_2"
    done = export_hf(checkpoint, tmp_path / "hf", dtype=torch.float32)
    assert done.architecture == "MixtralForCausalLM" and done.files == 1
    reference, cfg = bundled_reference(checkpoint)
    exported = assert_same_logits(reference, tmp_path / "hf", cfg.vocab_size)
    assert type(exported).__name__ == "MixtralForCausalLM"
    assert exported.config.num_local_experts == cfg.num_experts == 4
    # The stacked experts go out per expert, under the names (and shapes) transformers itself writes.
    from safetensors import safe_open
    from mfsdp.hf.files import weight_files
    from mfsdp.hf.names import load_hf_weights

    exported.save_pretrained(tmp_path / "resaved")
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as ours, \
            safe_open(tmp_path / "resaved" / "model.safetensors", "pt") as theirs:
        assert set(ours.keys()) == set(theirs.keys()) == set(weight_files(tmp_path / "hf"))
        for key in ours.keys():
            assert ours.get_slice(key).get_shape() == theirs.get_slice(key).get_shape(), key
            assert ours.get_slice(key).get_dtype() == "F32", key
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in set(weight_files(tmp_path / "hf"))
    # ... and the bundled loader reads them back into the stacked experts (the same rule, reversed).
    again = build_model(cfg, dtype=torch.float32)
    load_hf_weights(again, tmp_path / "hf")
    for (name, p), q in zip(reference.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name


def _hf_dir(family: str, path):
    from test_manager_models import make_hf
    from test_manager_moe import make_moe

    # The experts as transformers 5 saves them, each under its own names (Mixtral's in block_sparse_moe).
    moe = family in ("mixtral", "qwen2_moe")
    (make_moe(family, vocab=260) if moe else make_hf(family, vocab=260)).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_model_hf_runs_export_their_own_architecture(world, corpus, tmp_path, family):
    from mfsdp.hf.files import weight_files
    from mfsdp.hf.sharded import meta_model_from_config
    from mfsdp.train.export import export_hf

    source = _hf_dir(family, tmp_path / "source")
    # Through the manager (the bundled route's export: tests/test_finetune_recipe.py).
    out = train(world, corpus, tmp_path / "run", "--model.hf", str(source), "--model.hf_impl", "manager",
                shape=NO_SHAPE)
    checkpoint = out / "checkpoints" / "step_2"
    config = transformers.AutoConfig.from_pretrained(source)
    source.rename(tmp_path / "moved")  # the checkpoint recorded config.json: the export needs no source
    done = export_hf(out, tmp_path / "hf", dtype=torch.float32)
    assert done.architecture == type(meta_model_from_config(config)).__name__
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference = trained_state(checkpoint, reference)
    exported = assert_same_logits(reference, tmp_path / "hf", 260)
    assert type(exported) is type(reference)
    assert set(weight_files(tmp_path / "hf")) == set(weight_files(tmp_path / "moved"))  # the source's names
    # Trained weights, not the initial ones (norm scales start at one).
    assert not torch.equal(exported.model.norm.weight, torch.ones_like(exported.model.norm.weight))


def safetensors_dtypes(path) -> set:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {f.get_tensor(name).dtype for name in f.keys()}


def test_the_generation_config_is_the_source_directory_s(tmp_path):
    from mfsdp.hf.export import finish

    source, out = tmp_path / "source", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 7], temperature=0.6, do_sample=True
                                  ).save_pretrained(source)
    finish(out, {"bos_token_id": 1, "eos_token_id": 2}, torch.float32, str(source))
    assert (out / "generation_config.json").read_text() == (source / "generation_config.json").read_text()
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [2, 7]


def test_export_errors_are_one_line(tmp_path, capsys):
    from mfsdp.cli import main as cli_main

    assert cli_main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "mfsdp export: error:" in err and "neither a checkpoint" in err and len(err.splitlines()) == 1
    assert cli_main(["export", str(tmp_path), str(tmp_path / "out"), "--dtype", "fp8"]) == 2
    assert capsys.readouterr().err == "mfsdp export: error: export.dtype must be one of auto, bf16, fp32, got 'fp8'\n"


def test_the_run_tokenizer_goes_out_with_the_weights(world, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from mfsdp.train.export import export_hf

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(["def foo(): return 1", "import os, sys"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="<unk>",
                                                pad_token="<unk>")
    fast.save_pretrained(tmp_path / "tok")
    corpus = tmp_path / "bpe.tokens"
    prepare(stdlib_source(), corpus, tokenizer=str(tmp_path / "tok"), glob="ab*.py")
    out = train(world, corpus, tmp_path / "run")
    done = export_hf(out, tmp_path / "hf")
    assert done.tokenizer == str((tmp_path / "tok").resolve())
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded.encode("def foo") == fast.encode("def foo")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == fast.eos_token_id
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")  # made of the special ids
    assert (generation.eos_token_id, generation.pad_token_id) == (fast.eos_token_id, fast.pad_token_id)
    assert fast.pad_token_id is not None
