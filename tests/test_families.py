"""The drafter families after DFlash: DFlash2 (dynamic convolutions + candidate selector) and
DSpark (Markov head + confidence head).

- against speculators 0.9 (a reference no one here wrote, in .venv-engines): the same drafts
  and scores on the same target hidden states, the same loss on the same batch;
- each family's tiny run → export (both formats) → `load_drafter` and `AutoModel` → eval,
  lossless; pipeline == serial; a resume refuses a checkpoint of another family;
- bad input: an option out of range, another family's option, an export whose weights are
  not its declared family's: one line each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash.errors import CheckpointError, ConfigError, DFlashError
from dflash.model.drafter import DFlashDrafter, DrafterSpec, FrozenHead
from dflash.model.export import export_drafter, load_drafter
from tests.conftest import ENGINES_PY, ROOT, engines_python, run_records

pytestmark = pytest.mark.engines("vllm")  # last, once `make test` has made .venv-engines

OPTIONS = {"dflash2": {"drafter.dflash2.selector_rank": "16", "drafter.dflash2.selector_top_k": "8"},
           "dspark": {"drafter.dspark.markov_rank": "16"}}  # fmt: skip


def _family(name: str) -> dict[str, str]:
    return {"drafter.family": f'"{name}"', **OPTIONS.get(name, {})}


@pytest.fixture(scope="module")
def reference() -> dict:
    if not ENGINES_PY.exists():
        pytest.fail(f"{ENGINES_PY} is missing: `make test` (or `make engines`) builds it")
    proc = engines_python([str(ROOT / "tests" / "speculators_reference.py")], timeout=300)
    if "No module named 'speculators'" in proc.stderr:
        pytest.fail(f"speculators is not installed in {ENGINES_PY}: `make engines` installs it")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_drafts_and_scores_equal_speculators(reference, family):
    """DFlash2's greedy walk and DSpark's Markov-biased tokens (and its confidence) from the
    same exported weights and target hidden states: the same tokens, scores within 1e-4."""
    got = reference[family]["drafting"]
    assert got["ours"] == got["theirs"]
    assert got["score_diff"] < 1e-4


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_one_batch_loss_equals_speculators(reference, family):
    """The unary cross-entropy plus the selector's (DFlash2) or the Markov-biased
    cross-entropy plus the confidence BCE (DSpark), γ-weighted, on the same anchors: per
    supervised slot, within 1e-4 of speculators' eager loss."""
    got = reference[family]["training"]
    assert abs(got["ours_sum"] - got["theirs_sum"]) / got["slots"] < 1e-4


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_tiny_run_exports_loads_and_decodes_lossless(tiny_config, tmp_path, family, monkeypatch):
    """Train, export, load the export back (both formats), eval: lossless, as DFlash; and so
    without the family's head, which then reaches every decoding path."""
    import dflash.eval.decode as decode
    from dflash.eval import DecodeSettings, evaluate
    from dflash.model.target import load_target

    cfg = tiny_config(**_family(family), **{"eval.num_prompts": "2", "eval.max_new_tokens": "12"})
    records = run_records(cfg, timeout_s=240)
    (end,) = [r for r in records if r["event"] == "run_end"]
    assert end["eval_lossless"] is True and end["final_loss"] is not None
    method = "dspark" if family == "dspark" else "dflash"
    assert end["vllm_speculative_config"]["method"] == method
    export = Path(end["export_dir"])
    arch = {"dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}[family]
    assert json.loads((export / "config.json").read_text())["architectures"] == [arch]
    drafter = load_drafter(export)
    assert drafter.spec.family == family
    again = export_drafter(drafter, tmp_path / "spec", dtype=torch.float32, fmt="speculators")
    assert load_drafter(again).spec == drafter.spec
    target = load_target(cfg.target, torch.device("cpu"), 1)
    head = FrozenHead(target.embed_weight, target.lm_head_weight)
    prompts = [torch.randint(0, 400, (6,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for batch in (1, 2):
        rec = evaluate(target, drafter, head, prompts, DecodeSettings(max_new=12, batch_size=batch))
        assert rec["lossless"] is True and rec["family_head"] is True
    # the ablation: drafted from the backbone's logits alone, still lossless, on each path
    # (one prompt, a batch, sampled)
    asked: list[bool] = []
    propose = decode.propose

    def spy(*args, **kwargs):
        asked.append(kwargs.get("family_head", args[6] if len(args) > 6 else True))
        return propose(*args, **kwargs)

    monkeypatch.setattr(decode, "propose", spy)
    for batch, temperature in ((1, 0.0), (2, 0.0), (1, 0.8)):
        off = DecodeSettings(max_new=12, batch_size=batch, temperature=temperature, family_head=False)
        rec = evaluate(target, drafter, head, prompts, off)
        assert rec["family_head"] is False and rec["lossless"] is (True if temperature == 0 else None)
        assert asked and not any(asked)
        asked.clear()


def _spec(family: str, **kw: object) -> DrafterSpec:
    fam = {
        "dflash2": {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4},
        "dspark": {"markov_rank": 8, "confidence_head": True, "confidence_with_markov": True},
    }.get(family, {})
    return DrafterSpec(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
        vocab_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, target_layer_ids=[0, 2], num_target_layers=4,
        block_size=4, mask_token_id=63, layer_types=["full_attention"] * 2, sliding_window=8, family=family,
        **{**fam, **kw},
    )  # fmt: skip


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_automodel_computes_what_load_drafter_computes(tmp_path, family):
    """The export's own modeling file builds every family (its extra weights load) and its
    block states equal dflash's."""
    from transformers import AutoModel

    d = DFlashDrafter(_spec(family))
    d.init_weights(torch.Generator().manual_seed(1))
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "_conv." in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.2)
    path = export_drafter(d, tmp_path / "exp", dtype=torch.float32)
    hf = AutoModel.from_pretrained(str(path), trust_remote_code=True, dtype=torch.float32)
    assert set(dict(hf.named_parameters())) == set(dict(d.named_parameters()))
    R, T, Q = 2, 9, 4
    g = torch.Generator().manual_seed(2)
    emb, ctx = torch.randn(R, Q, 32, generator=g), torch.randn(R, T, 64, generator=g)
    ctx_pos, q_pos = torch.arange(T).expand(R, T), (T + torch.arange(Q)).expand(R, Q)
    full = torch.ones(R, 1, Q, T + Q, dtype=torch.bool)
    with torch.no_grad():
        a = d(emb, ctx, q_pos, ctx_pos, {"full_attention": full})
        b = hf(position_ids=torch.cat([ctx_pos, q_pos], 1), noise_embedding=emb, target_hidden=ctx)
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()


def test_convolutions_start_as_the_identity():
    """DFlash2 initialised computes what DFlash with the same draws computes: the
    convolutions are the identity until trained (speculators' initialisation)."""
    a, b = DFlashDrafter(_spec("dflash")), DFlashDrafter(_spec("dflash2"))
    a.init_weights(torch.Generator().manual_seed(0))
    b.init_weights(torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    emb, ctx = torch.randn(1, 8, 32, generator=g), torch.randn(1, 5, 64, generator=g)
    masks = {"full_attention": torch.ones(1, 1, 8, 13, dtype=torch.bool)}
    args = (emb, ctx, torch.arange(5, 13)[None], torch.arange(5)[None], masks)
    with torch.no_grad():
        assert torch.equal(a(*args), b(*args))


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"drafter.family": '"dflash2"', "drafter.dflash2.conv_kernel_size": "9"},
         "dflash2.conv_kernel_size (9) is larger than block_size (8)"),
        ({"drafter.family": '"dflash2"', "drafter.dflash2.selector_top_k": "1"}, "selector_top_k"),
        ({"drafter.family": '"dflash2"', "drafter.dspark.markov_rank": "16"},
         "drafter.dspark.markov_rank is set, but drafter.family is 'dflash2', not 'dspark'"),
        ({"drafter.dflash2.selector_rank": "16"}, "drafter.family is 'dflash', not 'dflash2'"),
        ({"drafter.family": '"dflare"'}, "drafter.family"),
        ({"drafter.family": '"dspark"', "loss.noise_reveal_start": "0.3"}, "with drafter.family 'dspark'"),
    ],
)  # fmt: skip
def test_bad_family_options_are_one_line(tiny_config, overrides, says):
    with pytest.raises(ConfigError) as err:
        tiny_config(**overrides)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_group_size_that_does_not_divide_the_hidden_size_is_one_line(tiny_config):
    from dflash.model.target import load_target
    from dflash.train.build import drafter_spec

    cfg = tiny_config(**{"drafter.family": '"dflash2"', "drafter.dflash2.conv_group_size": "24"})
    info = load_target(cfg.target, torch.device("cpu"), 1)  # a Target is its own TargetInfo
    with pytest.raises(ConfigError, match=r"conv_group_size \(24\) does not divide the target's hidden size \(64\)"):
        drafter_spec(cfg, info, 511)


def test_an_export_whose_weights_are_another_familys_is_one_line(tmp_path):
    path = export_drafter(DFlashDrafter(_spec("dflash2")), tmp_path / "exp", dtype=torch.float32)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["DFlashDraftModel"]  # declared DFlash, carrying DFlash2's weights
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        load_drafter(path)
    line = str(err.value)
    assert "weights do not match the drafter's config (dflash)" in line and "unexpected" in line
    assert "\n" not in line


def test_a_checkpoint_of_another_family_is_refused_on_resume(tiny_config):
    cfg = tiny_config(**_family("dflash2"), **{"checkpoint.every_steps": "2", "train.max_steps": "2"})
    run_records(cfg, timeout_s=240)
    other = tiny_config(**{"checkpoint.every_steps": "2", "train.max_steps": "4"})
    with pytest.raises(DFlashError) as err:
        run_records(other, timeout_s=240, resume=cfg.run_dir / "checkpoints" / "step_000002")
    assert "family" in str(err.value) and "\n" not in str(err.value)


def test_pipeline_equals_serial(tiny_config):
    """The DFlash2 and DSpark losses step for step: the pipeline's stages and the serial
    loop compute the same thing."""
    for family in ("dflash2", "dspark"):
        losses = []
        for mode in ("pipeline", "serial"):
            cfg = tiny_config(**_family(family), **{"pipeline.mode": f'"{mode}"', "eval.at_end": "false",
                                                    "train.max_steps": "4"})  # fmt: skip
            losses.append([r["loss"] for r in run_records(cfg, timeout_s=240) if r["event"] == "train_step"])
        assert losses[0] == losses[1] and len(losses[0]) == 4


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_resume_is_exact_and_replicas_sum_alike(tiny_config, tmp_path, family):
    """Two replicas a step, resumed from step 2 on one replica (grad_accum "auto" = 2): the
    later losses and the final weights equal the uninterrupted run's (to float-sum order) —
    the families' modules are saved, restored and reduced as the backbone's."""
    from safetensors.torch import load_file

    common = {
        **_family(family), "data.num_samples": "48", "train.epochs": "2", "eval.at_end": "false",
        "checkpoint.every_steps": "2", "checkpoint.keep_last": "20", "pipeline.prepare_ahead": "false",
    }  # fmt: skip
    full = tiny_config(**common, **{"pipeline.drafter_devices": '["cpu", "cpu"]'})
    a = run_records(full, timeout_s=240)
    one = tiny_config(**common, **{"run.output_dir": f'"{tmp_path / "one"}"'})
    b = run_records(one, timeout_s=240, resume=full.run_dir / "checkpoints" / "step_000002")
    la = {r["step"]: r["loss"] for r in a if r["event"] == "train_step"}
    lb = {r["step"]: r["loss"] for r in b if r["event"] == "train_step"}
    assert sorted(lb) == [s for s in sorted(la) if s > 2] and len(lb) >= 3
    assert all(abs(la[s] - lb[s]) <= 1e-6 * abs(la[s]) for s in lb)
    last = f"step_{max(la):06d}"
    wa = load_file(str(full.run_dir / "checkpoints" / last / "drafter.safetensors"))
    wb = load_file(str(one.run_dir / "checkpoints" / last / "drafter.safetensors"))
    assert any(k.startswith(("candidate_selector.", "markov_head.")) for k in wa)
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6) for k in wa)


def test_the_selector_ranks_the_logits_without_the_sampled_softmax_correction():
    """loss.vocab = "data": the drawn negatives' logits carry log(|outside| / K); the selector's
    candidates and unary scores are those serving sees, without it."""
    from dflash.model.dflash2 import SelectorTerms
    from dflash.model.modeling_dflash import CandidateSelector

    g = torch.Generator().manual_seed(0)
    selector = CandidateSelector(16, 8, 4, 4)
    for p in selector.parameters():
        p.data = torch.randn(p.shape, generator=g)
    raw, h = torch.randn(5, 16, generator=g), torch.randn(5, 8, generator=g)
    labels, prev = torch.randint(0, 16, (5,), generator=g), torch.randint(0, 16, (5,), generator=g)
    bias = torch.zeros(16)
    bias[10:] = 3.0
    terms = SelectorTerms(selector, 1.0)
    _, extra, ok = terms(raw + bias, h, labels, prev, None, None, bias)
    _, plain_extra, plain_ok = terms(raw, h, labels, prev, None, None, None)
    assert torch.allclose(extra, plain_extra) and torch.equal(ok, plain_ok)


@pytest.mark.parametrize("shift", [0, 1])
def test_under_dpace_the_family_terms_keep_the_gamma_decay(shift):
    """D-PACE weighs the token cross-entropy; the family's extra terms (selector CE,
    confidence BCE) keep the fixed γ decay, as speculators keeps them."""
    import math

    from dflash.model.loss import LossSpec, block_loss, block_targets

    B, gamma = 4, 2.0
    ids = torch.arange(20)[None] % 7
    anchors, valid = torch.tensor([[2, 9]]), torch.ones(1, 2, dtype=torch.bool)
    t = block_targets(ids, torch.ones(1, 20, dtype=torch.bool), torch.zeros(1, 20, dtype=torch.long), anchors,
                      valid, B, math.inf, None, shift)  # fmt: skip
    hidden, head = torch.zeros(1, 2 * B, 4), torch.zeros(7, 4)  # every logit 0: CE = log 7 everywhere

    def one_each(logits, h, labels, prev, cols, teacher, bias):  # an extra loss of 1 per row
        return logits, torch.ones(len(labels)), None

    spec = LossSpec(block_size=B, gamma=gamma, position_weights="dpace", shift=shift)
    with_extra = block_loss(hidden, head, t, spec, terms=one_each).loss_sum
    without = block_loss(hidden, head, t, spec).loss_sum
    want = sum(math.exp(-(k + shift - 1) / gamma) for k in t.slot.tolist())
    assert math.isclose(float(with_extra - without), want, rel_tol=1e-5)


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
def test_without_the_family_head_each_slot_drafts_the_backbones_argmax(family):
    """`eval.family_head = false`: no selector walk, no Markov bias, no confidence cut."""
    from dflash.model.families import propose

    torch.manual_seed(0)
    model = DFlashDrafter(_spec(family))
    with torch.no_grad():  # heads strong enough to change the drafts
        for name, p in model.named_parameters():
            if name.startswith(("candidate_selector.", "markov_head.")):
                p.normal_(0, 3.0)
    h, lm_head, anchor = torch.randn(5, 3, 32), torch.randn(64, 32), torch.randint(0, 64, (5,))
    argmax = (h @ lm_head.t()).argmax(dim=-1)
    got, _ = propose(model, h, lm_head, anchor, family_head=False)
    assert torch.equal(got, argmax)
    own, _ = propose(model, h, lm_head, anchor)
    assert torch.equal(own, argmax) == (family == "dflash")
    # sampled: the slots' softmax, which speculative sampling's verification reads
    _, q = propose(model, h, lm_head, anchor, 0.7, torch.Generator().manual_seed(0), family_head=False)
    assert q is not None and torch.allclose(q, torch.softmax((h @ lm_head.t()) / 0.7, dim=-1), atol=1e-6)


def test_without_the_family_head_dspark_verifies_every_draft(tiny_config):
    from dflash.eval import DecodeSettings
    from dflash.model.families import verify_lengths

    dspark = {**_family("dspark"), "drafter.dspark.confidence_threshold": "0.5"}
    assert DecodeSettings.of(tiny_config(**dspark), []).confidence == 0.5
    settings = DecodeSettings.of(tiny_config(**dspark, **{"eval.family_head": "false"}), [])
    assert settings.confidence == 0.0 and settings.family_head is False
    # and in decoding itself, whatever threshold it is given
    torch.manual_seed(0)
    model = DFlashDrafter(_spec("dspark"))
    with torch.no_grad():
        model.confidence_head.proj.bias.fill_(-20.0)  # trusts no draft
    h, anchor = torch.randn(2, 4, 32), torch.randint(0, 64, (2,))
    tokens = torch.randint(0, 64, (2, 4))
    assert verify_lengths(model, h, tokens, anchor, 0.5) == [1, 1]  # at least one
    assert verify_lengths(model, h, tokens, anchor, 0.5, family_head=False) == [4, 4]


def test_another_engine_refuses_eval_without_the_family_head(tiny_config, tmp_path):
    from dflash.eval.command import run_eval

    cfg = tiny_config(**{"eval.family_head": "false"})
    for engine in ("vllm", "llamacpp"):
        with pytest.raises(ConfigError, match=r"eval\.family_head = false") as err:
            run_eval(cfg, tmp_path / "nowhere", engine=engine)
        assert "\n" not in str(err.value) and f"--engine {engine}" in str(err.value)


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_vllm_on_cpu_is_refused_for_the_new_families_and_the_config_says_their_method(family):
    """vLLM's CPU build runs neither family (V1 refuses them, V2 needs Triton): `--engine vllm`
    says so in one line; the speculative_config names the method and the tokens drafted."""
    from dflash.serving import vllm

    spec = _spec(family)
    why = vllm.problem(spec, 64, on_cpu=True)
    assert why is not None and family in why and "Triton" in why and "\n" not in why
    conf = vllm.speculative_config("DIR", spec)
    assert conf["method"] == ("dspark" if family == "dspark" else "dflash")
    assert conf["num_speculative_tokens"] == (4 if family == "dspark" else 3)
