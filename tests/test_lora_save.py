"""What a LoRA run saves (CPU, fp32): checkpoints of the adapters and their optimizer state only,
resumed bit for bit on 2 gloo ranks (saved by the asynchronous checkpointer, whose staging holds that
small state); the disk check sized by the adapters; and the offline exports of such a checkpoint,
a PEFT adapter directory that ``PeftModel.from_pretrained`` loads with our logits, and the merged
model (untargeted weights the base's bit for bit, targets changed by rank <= r)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mfsdp.transforms.lora import LoraTransform, init_adapters, is_adapter, lora_linears
from mfsdp.hf.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from mfsdp.transforms.lora_export import hf_target_modules, peft_adapter_config
from mfsdp.train.checkpoint import CheckpointError, CheckpointMeta, load_checkpoint, save_checkpoint
from test_lora import randomize_b, tiny

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled", "ignore::UserWarning", "ignore::FutureWarning")]

LORA = LoraTransform(r=4, alpha=8, target_modules="q_proj,v_proj,w2")


def _lora_meta(model, base=None) -> CheckpointMeta:
    return CheckpointMeta(model={"dim": 32}, peft=peft_adapter_config(LORA, hf_target_modules(model), base))


def _sharded(adapter_seed: int, ws: int):
    """The tiny Llama's fixed base, adapters drawn from ``adapter_seed``, sharded over ``ws`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp.models.parallelize import ParallelizeConfig, parallelize

    model = tiny(seed=4)  # the base: the same in every build, as a base directory's would be
    parallelize(model, init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",)), ParallelizeConfig(transforms=(LORA,)))
    init_adapters(model, seed=adapter_seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    return model, optimizer


def _steps(model, optimizer, steps, rank, ws) -> list[float]:
    import torch.nn.functional as F

    losses = []
    for step in steps:
        tokens = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(30 + step)).chunk(ws)[rank]
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _resume_case(rank, ws, root):
    from mfsdp.train.build.adapters import checkpointed_numel
    from mfsdp.train.checkpoint import Checkpointer

    model, optimizer = _sharded(1, ws)
    straight = _steps(model, optimizer, range(1, 5), rank, ws)
    want = {n: p.full_tensor() for n, p in model.named_parameters()}
    model, optimizer = _sharded(1, ws)
    first = _steps(model, optimizer, range(1, 3), rank, ws)
    saver = Checkpointer(root, keep=2, asynchronous=True, model=model, optimizer=optimizer)
    saver.save(2, model, optimizer, _lora_meta(model))
    staged = saver._stager.nbytes()
    saver.close()
    model, optimizer = _sharded(2, ws)  # other adapters: the checkpoint's must replace them
    meta = load_checkpoint(f"{root}/step_2", model, optimizer)
    rest = _steps(model, optimizer, range(3, 5), rank, ws)
    got = {n: p.full_tensor() for n, p in model.named_parameters()}
    same = set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    everything = sum(p.to_local().numel() for p in model.parameters())
    return straight == first + rest, same, meta.peft["r"], staged, checkpointed_numel(model), everything


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_bit_for_bit(world, tmp_path):
    exact, same, r, staged, adapters, everything = world(2).run(_resume_case, root=str(tmp_path))[0]
    assert exact and same and r == 4
    saved = dcp.FileSystemReader(tmp_path / "step_2").read_metadata().state_dict_metadata
    model_keys = {k for k in saved if k.startswith("model.")}
    assert model_keys and all(is_adapter(k) for k in model_keys), sorted(model_keys)[:4]
    assert len(model_keys) == 2 * 3 * 2  # A and B of three linears in each of two blocks
    assert {k.split(".")[0] for k in saved} == {"model", "optimizer", "rng"}
    # The staging holds the adapters' shard, its two AdamW moments and small scalars, not the base.
    assert adapters < everything / 3
    assert 12 * adapters <= staged < 12 * adapters + 64 * 40 + 8192, (staged, adapters)


def test_a_lora_checkpoint_and_a_full_model_refuse_each_other(tmp_path):
    model = tiny()
    LORA.apply(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    save_checkpoint(tmp_path, 1, model, optimizer, _lora_meta(model))
    plain = tiny()
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters only but this run trains every weight; "
                       r"resume with the --peft\.\* settings"):
        load_checkpoint(tmp_path / "step_1", plain, torch.optim.AdamW(plain.parameters()))
    save_checkpoint(tmp_path / "full", 1, plain, torch.optim.AdamW(plain.parameters()), CheckpointMeta(model={}))
    with pytest.raises(CheckpointError, match="holds every weight .no LoRA adapters. but this run is a LoRA model"):
        load_checkpoint(tmp_path / "full" / "step_1", model, optimizer)


def test_the_disk_check_sizes_the_adapters_and_their_adamw_state(monkeypatch, tmp_path):
    from mfsdp.train.run import disk
    from mfsdp.train.run.resolve import load_config

    def cfg(*flags):
        return load_config(["--model.preset", "8b", "--train.out_dir", str(tmp_path), *flags])

    lora = cfg("--peft.method", "lora")
    assert disk.checkpointed_params(lora) == 41_943_040  # r 16 on the 7 linears of 32 blocks
    assert disk.checkpointed_params(cfg("--peft.method", "lora", "--peft.lora_r", "8",
                                        "--peft.target_modules", "q_proj,v_proj")) == 32 * 8 * (2 * 4096 + 4096 + 1024)
    monkeypatch.setattr(disk, "free_space", lambda path: (tmp_path, 2 * disk.GIB))
    assert disk.check_disk(lora) is None  # 0.5 GB each, three at once
    with pytest.raises(disk.ConfigError, match=r"takes 89\.\d\d GiB"):
        disk.check_disk(cfg())
    monkeypatch.setattr(disk, "free_space", lambda path: (tmp_path, 100 * 2**20))
    with pytest.raises(disk.ConfigError, match=r"one checkpoint of this run takes 0\.47 GiB \(the LoRA adapters: "
                       r"fp32 main weights and AdamW moments\)"):
        disk.check_disk(lora)


# ------------------------------------------------------------------------------ exports
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA run's checkpoint on a tiny Hugging Face Llama directory (with a tokenizer's files and a
    chat template), the bundled model it came from, and the base directory."""
    from test_manager_models import make_hf

    from mfsdp.hf.config import bundled_config_from_hf
    from mfsdp.hf.names import load_hf_weights
    from mfsdp.models import Llama
    from mfsdp.train.build.adapters import adapter_record
    from mfsdp.train.run.resolve import load_config

    root = tmp_path_factory.mktemp("lora_export")
    base = root / "base"
    make_hf("llama", vocab=62).save_pretrained(base)
    (base / "chat_template.jinja").write_text("{{ messages }}")
    (base / "tokenizer_config.json").write_text("{}")
    model = Llama(bundled_config_from_hf(base, 12))
    load_hf_weights(model, base)
    LORA.apply(model)
    randomize_b(model)
    runs = {}
    for merge in ("false", "true"):
        cfg = load_config(["--model.hf", str(base), "--peft.method", "lora", "--peft.lora_r", "4", "--peft.lora_alpha",
                           "8", "--peft.target_modules", ",".join(LORA.target_modules),
                           "--train.export_hf", "true", "--train.save_dtype", "fp32", "--peft.merge_on_export", merge])
        meta = CheckpointMeta(model={}, config=cfg.to_dict(), hf_config=json.loads((base / "config.json").read_text()),
                              peft=adapter_record(cfg, model))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        runs[merge] = save_checkpoint(root / merge, 3, model, optimizer, meta)
    return model.eval(), base, runs


def _hf(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


TOKENS = torch.randint(0, 62, (3, 12), generator=torch.Generator().manual_seed(5))


def test_mfsdp_export_of_a_lora_checkpoint_is_a_peft_adapter_with_our_logits(trained, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    from mfsdp.cli import main as cli

    model, base, runs = trained
    assert cli(["export", str(runs["false"]), str(tmp_path / "adapter")]) == 0
    assert "wrote a PEFT LoRA adapter" in capsys.readouterr().out
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert {k: config[k] for k in ("base_model_name_or_path", "r", "lora_alpha", "target_modules", "peft_type",
                                   "task_type")} == dict(base_model_name_or_path=str(base), r=4, lora_alpha=8.0,
                                                         target_modules=["down_proj", "q_proj", "v_proj"],
                                                         peft_type="LORA", task_type="CAUSAL_LM")
    assert (tmp_path / "adapter" / ADAPTER_WEIGHTS).stat().st_size < 40_000
    loaded = peft.PeftModel.from_pretrained(_hf(base), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert float((loaded(TOKENS).logits - model(TOKENS)).abs().max()) < 1e-5


def _export_at_the_end(rank, ws, checkpoint, out):
    from pathlib import Path

    from mfsdp.train.report.epilogue import export_hf

    said = []
    export_hf(Path(checkpoint), Path(out), said.append, torch.float32)
    return said


def test_export_hf_at_the_end_of_a_lora_run_writes_the_adapter(trained, world, tmp_path):
    model, base, runs = trained
    said = world(2).run(_export_at_the_end, checkpoint=str(runs["false"]), out=str(tmp_path / "hf"))
    assert said[1] == [] and said[0][0].startswith(f"wrote a PEFT LoRA adapter to {tmp_path / 'hf'}: 12 tensors"), said
    assert f"peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained('{base}')" in said[0][0]
    assert json.loads((tmp_path / "hf" / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(base)


def test_merge_on_export_writes_the_merged_model_with_the_base_tokenizer(trained, tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from mfsdp.hf.export import exported_line
    from mfsdp.train.export import export_hf

    model, base, runs = trained
    done = export_hf(runs["true"], tmp_path / "merged")  # the run's --peft.merge_on_export true
    assert "AutoModelForCausalLM.from_pretrained" in exported_line(done) and done.tokenizer == str(base)
    for name in ("chat_template.jinja", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (tmp_path / "merged" / name).is_file(), name
    export_hf(runs["false"], tmp_path / "adapter")
    adapted = peft.PeftModel.from_pretrained(_hf(base), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert float((_hf(tmp_path / "merged")(TOKENS).logits - adapted(TOKENS).logits).abs().max()) < 1e-5
    merged, original = load_file(tmp_path / "merged" / "model.safetensors"), load_file(base / "model.safetensors")
    assert set(merged) == set(original)
    targets = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "self_attn.v_proj",
                                                                          "mlp.down_proj")}
    for name, weight in merged.items():
        if name in targets:
            assert 1 <= torch.linalg.matrix_rank((weight - original[name]).double(), rtol=1e-4) <= 4, name
        else:
            assert weight.dtype == original[name].dtype and torch.equal(weight, original[name]), name
    assert len(lora_linears(model)) == len(targets)
    # `mfsdp export --peft.merge_on_export` overrides the run's choice, both ways.
    from mfsdp.cli import main as cli
    assert cli(["export", str(runs["false"]), str(tmp_path / "merged_cli"), "--peft.merge_on_export", "true"]) == 0
    assert load_file(tmp_path / "merged_cli" / "model.safetensors").keys() == merged.keys()
    assert cli(["export", str(runs["true"]), str(tmp_path / "adapter_cli"), "--peft.merge_on_export", "false"]) == 0
    assert (tmp_path / "adapter_cli" / ADAPTER_CONFIG).is_file()
