"""``--train.save_only_model``: checkpoints of the model's weights alone (in ``--train.save_dtype``),
written by real two-rank CPU runs, synchronously and in the background; their size, a resume that
starts the optimizer afresh, ``mfsdp export`` of them, the disk check that names them, the older
meta.json formats, and a ``--model.hf`` run's tokenizer files going out with its export."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mfsdp.data import prepare
from mfsdp.data.prepare import stdlib_source
from mfsdp.models import param_counts
from mfsdp.train.checkpoint import (CheckpointError, Checkpointer, CheckpointMeta, find_latest, load_checkpoint,
                                    save_checkpoint, staging_bytes)
from mfsdp.train.checkpoint.storage import state_of
from mfsdp.train.run.config import ConfigError
from mfsdp.train.run.resolve import load_config
from test_eval_loss import SMALL, run_trainer
from test_prelaunch_checks import launch  # noqa: F401  (the disk check's fixture)
from test_train_checkpoint import META, make
from test_train_e2e import stopped_copy

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

RUN = [*SMALL, "--train.steps", "4", "--train.checkpoint_every", "2", "--train.keep_checkpoints", "0",
       "--data.local_batch", "2", "--train.eval_every", "0"]
MODEL_ONLY = ["--train.save_only_model", "true"]
RESUMED = ("resumed the weights from {} at step 2; the optimizer state starts fresh (the checkpoint holds "
           "the model only)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("model_only") / "small.tokens"
    prepare(stdlib_source(), path, glob="a*.py")
    return path


def train(world, corpus, out, *args, base=RUN) -> str:
    """The run on two ranks of the session's world; what rank 0 printed."""
    return world(2).run(run_trainer, argv=[*base, "--data.path", str(corpus), "--train.out_dir", str(out), *args],
                        stdout=True)[0][1]


@pytest.fixture(scope="module")
def runs(world, corpus, tmp_path_factory):
    """The same 4 steps three times, saving at steps 2 and 4: the full state (synchronously), the
    weights in fp32 (synchronously) and the weights in bf16 (in the background)."""
    root = tmp_path_factory.mktemp("runs")
    train(world, corpus, root / "full")
    train(world, corpus, root / "fp32", *MODEL_ONLY, "--train.save_dtype", "fp32")
    log = train(world, corpus, root / "bf16", *MODEL_ONLY, "--train.save_dtype", "bf16",
                "--train.async_checkpoint", "true")
    assert "checkpoints are written in the background" in log and "checkpoint step_4 saved" in log, log
    return root


def tensors(checkpoint, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``checkpoint`` whose key starts with ``prefix``, read in one process."""
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items()
             if k.startswith(prefix) and hasattr(m, "size")}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return state


def on_disk(checkpoint) -> int:
    return sum(p.stat().st_size for p in checkpoint.iterdir())


def test_a_model_only_checkpoint_holds_the_weights_alone_in_its_dtype(runs):
    params = param_counts(load_config(RUN).resolved.shape)["total"]
    for name, size in (("fp32", 4), ("bf16", 2)):
        checkpoint = runs / name / "checkpoints" / "step_4"
        meta = CheckpointMeta.read(checkpoint)
        assert (meta.format, meta.contents, meta.weights_dtype, meta.model_only) == (2, "model", name, True)
        saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
        assert {k.split(".")[0] for k in saved} == {"model", "rng"}  # no optimizer state
        assert {m.properties.dtype for k, m in saved.items() if k.startswith("model.")} == {getattr(torch, {
            "fp32": "float32", "bf16": "bfloat16"}[name])}
        # The weights, plus torch.save's header of each shard written (about 1.5 kB), the two ranks'
        # generator states (5 kB each), .metadata and meta.json.
        chunks = len(dcp.FileSystemReader(checkpoint).read_metadata().storage_data)
        assert params * size <= on_disk(checkpoint) <= params * size + 2048 * chunks + 32 * 1024, name
    full = CheckpointMeta.read(runs / "full" / "checkpoints" / "step_4")
    assert (full.contents, full.weights_dtype) == ("full", "fp32")
    assert on_disk(runs / "full" / "checkpoints" / "step_4") >= 12 * params


def test_fp32_weights_are_the_full_checkpoints_main_weights_bit_for_bit(runs):
    full, fp32, bf16 = (tensors(runs / n / "checkpoints" / "step_4", "model.") for n in ("full", "fp32", "bf16"))
    assert full.keys() == fp32.keys() == bf16.keys() and full
    for key, value in full.items():
        assert torch.equal(fp32[key], value), key
        assert torch.equal(bf16[key], value.to(torch.bfloat16)), key


def test_a_resume_loads_the_weights_and_starts_the_optimizer_afresh(runs, world, corpus, tmp_path):
    out = stopped_copy(runs / "bf16", 2, tmp_path / "resumed")
    # Resumed with full saves, so the step-4 checkpoint shows the optimizer's own step count.
    log = train(world, corpus, out, "--resume")
    checkpoint = out / "checkpoints" / "step_2"
    assert RESUMED.format(checkpoint) in log.splitlines() and "Traceback" not in log, log
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 4] and all(r["loss"] == r["loss"] for r in records)
    final = out / "checkpoints" / "step_4"
    assert find_latest(out / "checkpoints") == final and not CheckpointMeta.read(final).model_only
    steps = {v.item() for k, v in tensors(final, "optimizer.state.").items() if k.endswith(".step")}
    assert steps == {2.0}  # two steps since the resume, not four


def test_a_model_only_checkpoint_loads_back_exactly_and_leaves_the_optimizer_alone(tmp_path):
    model, optimizer = make(0)
    for dtype in (torch.float32, torch.bfloat16):
        path = save_checkpoint(tmp_path / str(dtype), 3, model, optimizer, META, save_dtype=dtype)
        other = torch.nn.Linear(8, 8)
        fresh = torch.optim.AdamW(other.parameters(), lr=0.1)
        assert load_checkpoint(path, other, fresh).model_only and not fresh.state
        assert torch.equal(other.weight, model.weight.detach().to(dtype).float())


def test_the_background_staging_holds_the_model_only_bytes(tmp_path):
    model, optimizer = make(0)
    saver = Checkpointer(tmp_path, keep=2, asynchronous=True, model=model, optimizer=optimizer,
                         save_dtype=torch.bfloat16)
    path = saver.save(1, model, optimizer, META)
    state = state_of(model, optimizer, model_only=True)
    assert "optimizer" not in state and saver._stager.nbytes() == staging_bytes(state, torch.bfloat16)
    saver.close()
    n = model.weight.numel() + model.bias.numel()
    assert 2 * n <= staging_bytes(state, torch.bfloat16) <= 2 * n + 8192  # the weights and the generator
    assert CheckpointMeta.read(path).weights_dtype == "bf16"
    assert torch.equal(tensors(path, "model.")["model.weight"], model.weight.detach().to(torch.bfloat16))


def test_mfsdp_export_of_a_model_only_checkpoint_equals_that_of_the_full_one(runs, tmp_path):
    from safetensors.torch import load_file

    from mfsdp.cli import main as cli_main

    def exported(run: str, dtype: str) -> dict:
        out = tmp_path / f"{run}-{dtype}"
        assert cli_main(["export", str(runs / run / "checkpoints" / "step_4"), str(out), "--dtype", dtype]) == 0
        assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        return load_file(out / "model.safetensors")

    for run, dtype in (("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")):
        mine, full = exported(run, dtype), exported("full", dtype)
        assert mine.keys() == full.keys() and all(torch.equal(mine[k], full[k]) for k in full), (run, dtype)


def test_the_disk_check_names_save_only_model_where_the_weights_would_fit(launch):  # noqa: F811
    # Half a full checkpoint of room: the fp32 weights (a third of one) fit, the full state does not.
    code, err, _, started = launch(0.5, "--train.checkpoint_every", "0")
    assert code == 2 and not started and err.count("\n") == 1, err
    assert "--train.save_only_model true (1 of its" in err and "checkpoints in fp32 fit)" in err, err
    code, err, _, started = launch(0.5, "--train.checkpoint_every", "0", *MODEL_ONLY)
    assert code == 0 and started and err == "", err
    # Three at once (two kept and the one being written) of the bf16 weights, a sixth each, fit in one.
    code, err, _, started = launch(1.0, *MODEL_ONLY, "--parallel.compute_dtype", "bf16")
    assert code == 0 and started and err == "", err
    code, err, _, started = launch(0.4, *MODEL_ONLY)
    assert code == 0 and started and "room for 1: a later save" in err and "(the model's" not in err, err
    code, err, _, _ = launch(0.2, *MODEL_ONLY)
    assert code == 2 and "(the model's weights in fp32)" in err and "save_only_model" not in err, err


def test_meta_json_of_the_formats_before_contents_reads_as_the_full_state(tmp_path):
    model, optimizer = make(0)
    path = save_checkpoint(tmp_path, 3, model, optimizer, META)
    record = json.loads((path / "meta.json").read_text())
    assert (record["format"], record["contents"], record["weights_dtype"]) == (2, "full", "fp32")
    for old in ({"format": 1}, {}):  # format 1, and format 0 (no "format" at all)
        kept = {k: v for k, v in record.items() if k not in ("format", "contents", "weights_dtype")}
        (path / "meta.json").write_text(json.dumps({**kept, **old}))
        meta = CheckpointMeta.read(path)
        assert (meta.format, meta.contents, meta.weights_dtype, meta.model_only) == (old.get("format", 0), "full",
                                                                                     "fp32", False)
        other, fresh = make(1)
        load_checkpoint(path, other, fresh)
        assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    (path / "meta.json").write_text(json.dumps({**record, "contents": "weights"}))
    with pytest.raises(CheckpointError, match=r"unreadable meta.json \(contents 'weights' \(one of full, model\)"):
        CheckpointMeta.read(path)


def test_save_dtype_needs_save_only_model():
    assert load_config([*MODEL_ONLY]).save_dtype("cuda") == torch.bfloat16  # auto: the compute dtype
    assert load_config([*MODEL_ONLY]).save_dtype("cpu") == torch.float32
    assert load_config([*MODEL_ONLY, "--train.save_dtype", "bf16"]).save_dtype("cpu") == torch.bfloat16
    assert load_config([]).save_dtype("cuda") is None
    with pytest.raises(ConfigError, match="--train.save_dtype applies to --train.save_only_model true"):
        load_config(["--train.save_dtype", "fp32"])
    with pytest.raises(ConfigError, match="train.save_dtype must be one of auto, fp32, bf16"):
        load_config([*MODEL_ONLY, "--train.save_dtype", "fp16"])


# ------------------------------------------------------------------ --model.hf: the tokenizer goes out too
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen2 directory with a byte-level BPE tokenizer and a chat template of its own."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from test_manager_models import make_hf

    path = tmp_path_factory.mktemp("hf") / "tiny-qwen2"
    make_hf("qwen2", vocab=300).save_pretrained(path)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(["def foo(): return 1", "import os, sys"] * 10, trainers.BpeTrainer(
        vocab_size=290, special_tokens=["<unk>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="<unk>").save_pretrained(path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def test_a_model_hf_runs_export_carries_its_tokenizer_files_and_chat_template(world, hf_dir, tmp_path):
    import transformers

    from mfsdp.hf.export import TOKENIZER_FILES
    from mfsdp.train.export import export_hf

    base = [a for flag, value in zip(RUN[::2], RUN[1::2]) if not flag.startswith("--model.") for a in (flag, value)]
    out, tokens = tmp_path / "run", tmp_path / "hf.tokens"
    prepare(stdlib_source(), tokens, tokenizer=str(hf_dir), glob="ab*.py")  # a run refuses another tokenizer's file
    log = train(world, tokens, out, "--model.hf", str(hf_dir), "--train.export_hf", "true", *MODEL_ONLY, base=base)
    names = sorted(n for n in TOKENIZER_FILES if (hf_dir / n).is_file())
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(names)
    for name in names:
        assert (out / "hf" / name).read_bytes() == (hf_dir / name).read_bytes(), name
    assert f"tokenizer from {hf_dir}" in log, log
    loaded = transformers.AutoTokenizer.from_pretrained(out / "hf")
    assert loaded.chat_template == CHAT_TEMPLATE
    assert transformers.AutoModelForCausalLM.from_pretrained(out / "hf").config.vocab_size == 300
    # `mfsdp export` copies them too while the directory is there; once it is gone, the token file's
    # tokenizer (that directory: gone too, so none) as before.
    assert export_hf(out, tmp_path / "again").tokenizer == str(hf_dir)
    shutil.move(hf_dir, tmp_path / "moved")
    try:
        done = export_hf(out, tmp_path / "gone")
    finally:
        shutil.move(tmp_path / "moved", hf_dir)
    assert done.tokenizer is None and not any((tmp_path / "gone" / n).exists() for n in names)
