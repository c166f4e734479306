"""The training loop: data, draft, optimizer and checkpoints of a run folder, the step (one CUDA graph on a GPU),
validation at every checkpoint, and the draft written in the public DFlash format.

A run folder holds data.pt (the prompts and answers, so a resumed run does not generate them again; with the
target and the data settings they were made for, so that no other run reuses them),
checkpoint.pt (the draft, the optimizer state, the step and the validation record; --resume continues from it),
validation.json, and draft/ (the best validation check's draft, or the last step's).
"""
from __future__ import annotations

import hashlib
import json
import pickle
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import EngineError
from ..loading import Target, save_dflash
from ..model import Rotary
from ..results import atomic_torch_save, remove_stale_temporaries, write_json
from .data import check_positions, draw_batch, generate_data, pack
from .draft_pass import draft_logits_train, initial_draft
from .features import feature_bank, target_features
from .loss import accepted_prefix, block_loss, target_block_logits
from .schedule import RATE_WINDOW, learning_rate, steps_in_budget
from .settings import TrainSettings


@dataclass
class TrainResult:
    draft_dir: Path        # the draft in the public DFlash format
    steps: int             # the step count trained to (what --minutes set, when given)
    first_step: int        # where this run started: 0, or the checkpoint's step when resumed
    data_reused: bool      # data.pt was there already
    features: str          # the feature bank's storage ("bfloat16", "float8 e4m3", ...) or "target in every step"
    graphed: bool          # every step replayed one CUDA graph
    validation: dict | None  # what validation.json holds: {sequences, checks: [{step, tau, loss}, ...]}, or None
    best_step: int | None  # the step whose draft draft_dir holds (None: the last step's, no validation)


def read_run_file(path: Path, device=None) -> dict:
    """data.pt or checkpoint.pt of a run folder. Loaded with weights_only: tensors and plain containers, never
    pickled code, so a crafted run folder cannot run anything."""
    try:
        obj = torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise EngineError(f"{path}: not a file that train-draft wrote ({reason})") from None
    if not isinstance(obj, dict):
        raise EngineError(f"{path}: not a file that train-draft wrote (a {type(obj).__name__}, not a dict)")
    return obj


# The settings the prompts and answers depend on, besides the target (gen_batch too: it sets how the sampled
# self-written prompts draw from the seeded stream).
DATA_SETTINGS = ("prompts", "new_tokens", "self_written", "gen_batch", "seed")


def target_fingerprint(target: Target) -> str:
    """The target as far as its answers go, whatever path named it: a hash of every weight's name, shape and dtype
    with a strided sample of its values (all of a large target's would take seconds), and of its tokenizer."""
    h = hashlib.sha256()
    for name, w in sorted(target.model.state_dict().items()):
        flat = w.detach().flatten()
        h.update(f"{name} {tuple(w.shape)} {w.dtype}".encode())
        h.update(flat[::max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes())
    tok = target.tokenizer
    if tok is not None:
        h.update(json.dumps([sorted(tok.get_vocab().items()), getattr(tok, "chat_template", None)]).encode())
    return h.hexdigest()[:16]


def _target_name(target: Target) -> str:
    return f"{target.name}, {str(target.model.dtype).removeprefix('torch.')}"


def _check_made_for(path: Path, made_for, key: dict, name: str) -> None:
    """Refuse a data.pt made for another target or other data settings (or one that does not say: an older
    train-draft's), naming what differs."""
    fix = f"pass another --out, or remove {path} to generate this run's data"
    if not isinstance(made_for, dict):
        raise EngineError(f"{path} does not record the target and the data settings it was made for (an older "
                          f"train-draft wrote it): {fix}")
    for k, want in key.items():
        if made_for.get(k) != want:
            what = (f"another target ({made_for.get('target_name')}, fingerprint {made_for.get(k)}; this run's: "
                    f"{name}, {want})" if k == "target"
                    else f"--{k.replace('_', '-')} {made_for.get(k)} (this run's: {want})")
            raise EngineError(f"{path} was made for {what}: {fix}")


def _data(target: Target, settings: TrainSettings, path: Path, log) -> tuple[list[dict], bool]:
    """The run's prompts and answers: read from data.pt when it was made for this target and these data settings
    (refused when not), or generated and saved there. Also whether they were read."""
    key = dict(target=target_fingerprint(target), **{k: getattr(settings, k) for k in DATA_SETTINGS})
    if path.exists():
        stored = read_run_file(path)
        _check_made_for(path, stored.get("made_for"), key, _target_name(target))
        data = stored.get("data")
        if not isinstance(data, list) or not all(isinstance(d, dict) and {"ids", "prompt_len"} <= d.keys()
                                                 for d in data):
            raise EngineError(f"{path}: not a file that train-draft wrote (no list of sequences under 'data')")
        log(f"data: {len(data)} sequences from {path}")
        return data, True
    t0 = time.perf_counter()
    data = generate_data(target, settings, log=log)
    path.parent.mkdir(parents=True, exist_ok=True)
    made_for = dict(key, target_name=_target_name(target))
    atomic_torch_save(dict(data=data, settings=asdict(settings), made_for=made_for), path)
    log(f"data: {len(data)} sequences, {sum(len(d['ids']) - d['prompt_len'] for d in data)} answer tokens, "
        f"{time.perf_counter() - t0:.0f} s")
    return data, False


def _split_validation(n: int, settings: TrainSettings, device, log) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(validation sequences, training sequences): a seeded choice of whole batches, at most a tenth of the data,
    never drawn for a step."""
    n_val = min(settings.validation, n // 10) // settings.batch * settings.batch
    if not n_val:
        if settings.validation:
            log(f"validation: none (a tenth of {n} sequences is less than one batch of {settings.batch})")
        return None, torch.arange(n, device=device)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(settings.seed)).to(device)
    log(f"validation: {n_val} sequences kept out of training")
    return order[:n_val], order[n_val:]


def graphed_step(fn, params, example: tuple[torch.Tensor, ...]):
    """fn(*batch) -> outputs, run once on `example` (warm-up, gradients discarded), then captured as one CUDA graph;
    the returned step copies a batch into the graph's inputs and replays it. Every batch has one shape (draw_batch),
    and eagerly the step is bound by the host: about 4,900 kernel launches for 40 ms of GPU work on the H200.
    fn's backward leaves the gradients in the graph's own tensors, which each replay overwrites: no zero_grad."""
    inputs = tuple(x.clone() for x in example)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*inputs)

    def step(*batch):
        for dst, src in zip(inputs, batch):
            dst.copy_(src)
        graph.replay()
        return outputs
    return step


def train(target: Target, settings: TrainSettings, device, resume: bool = False, log=print,
          cuda_graph: bool = True) -> TrainResult:
    """Train (or with `resume`, continue) a draft per `settings` in the run folder settings.out. On a GPU each step's
    forward and backward replay as one CUDA graph (graphed_step), unless cuda_graph is False."""
    from tqdm import tqdm

    out = Path(settings.out)
    ckpt_path, data_path = out / "checkpoint.pt", out / "data.pt"
    settings.check(resume)
    if ckpt_path.exists() and not resume:
        raise EngineError(f"{out} already holds a training run: pass --resume to continue it, or another --out")
    remove_stale_temporaries(out)  # what a killed run left half-written
    amp = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    # what can refuse the run comes before the data, which takes the target minutes to hours: a bad --init draft,
    # lengths past the target's position limit (check_positions), a data.pt of another target or other settings
    draft = initial_draft(target, settings, log).to(device)
    check_positions(target, settings)
    data, data_reused = _data(target, settings, data_path, log)  # the run folder exists from here on
    # fused: one launch for the whole update (the step is bound by the host)
    opt = torch.optim.AdamW(draft.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=device.type == "cuda")
    step, checks = 0, []  # checks: the validation record, {step, tau, loss} per checkpoint
    if resume and ckpt_path.exists():
        ck = read_run_file(ckpt_path, device)
        try:
            draft.load_state_dict(ck["draft"])
            opt.load_state_dict(ck["optimizer"])
            step, checks = int(ck["step"]), list(ck.get("validation", []))
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise EngineError(f"{ckpt_path}: does not fit this recipe's draft ({str(e).splitlines()[0]})") from None
        log(f"resuming at step {step}")
        if not (out / "draft").exists():
            # killed between this checkpoint and its draft (or inside save_dflash): the checkpoint's draft is the one
            # draft/ was being written from; without it, a run with no steps left (or no better check) has no draft
            save_dflash(draft, target, out / "draft")
            log(f"draft: {out / 'draft'} written again from the checkpoint of step {step}")
    model = target.model  # frozen; its embedding and LM head are the draft's, as at inference
    embed_w, head_w = model.embed_tokens.weight, model.lm_head.weight
    rotary = Rotary(draft.dcfg.layers, device)  # the draft's own RoPE, as at inference
    packed = pack(data, device)
    val_idx, train_idx = _split_validation(len(data), settings, device, log)
    n_val = 0 if val_idx is None else len(val_idx)
    # the context features as at inference (target_features), computed once for all sequences when they fit
    # (feature_bank), else in every step; distillation also needs the target's final hidden states, so it runs the
    # target in every step.
    layers = draft.dcfg.target_layer_ids
    bank = feature_bank(model, packed, layers, settings.batch, log) if settings.distill == 0 else None
    features_of = target_features(model, packed[0].shape[1], settings.batch, layers) if bank is None else None

    draft_pass = draft_logits_train
    if settings.compile and device.type == "cuda":  # compiled in the first call: the CUDA graph's warm-up
        draft_pass = torch.compile(draft_logits_train)

    @torch.no_grad()
    def context_features(tokens, rows=None):
        """(the target's final hidden states or None, context features) of a batch: its bank rows, or the target."""
        return (None, bank.rows[rows]) if rows is not None else features_of(tokens)

    def loss_and_grads(tokens, lengths, anchors, rows=None):
        final_hidden, feats = context_features(tokens, rows)
        # no autocast weight cache: a CUDA graph must not keep casts made during its capture
        with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32, cache_enabled=False):
            logits = draft_pass(draft, rotary, embed_w, head_w, feats, tokens, anchors)
            teacher = None
            if settings.distill > 0:
                with torch.no_grad():
                    teacher = target_block_logits(final_hidden, head_w, anchors, settings.block_size)
            loss, right = block_loss(logits, tokens, anchors, lengths, settings.gamma, teacher=teacher,
                                     distill=settings.distill)
        loss.backward()
        return loss.detach(), right

    # batches are drawn on the device; a resumed run draws new ones
    gen = torch.Generator(device=device).manual_seed(settings.seed * 1_000_003 + step)

    def draw(idx, generator):
        batch = draw_batch(packed, idx, settings.anchors, generator)
        return batch if bank is None else (*batch, bank.row_index(packed, idx))

    def next_batch():
        return draw(train_idx[torch.randint(len(train_idx), (settings.batch,), generator=gen, device=device)], gen)

    # the same validation blocks at every check: anchors drawn once, from their own seed
    val_gen = torch.Generator(device=device).manual_seed(settings.seed + 1)
    val_batches = [draw(val_idx[i:i + settings.batch], val_gen) for i in range(0, n_val, settings.batch)]

    @torch.no_grad()
    def validate() -> tuple[float, float]:
        """(teacher-forced tau: 1 + the mean accepted_prefix, mean loss) over the validation blocks; eager, a few
        batches per checkpoint."""
        prefix, loss = 0, 0.0
        for tokens, lengths, anchors, *rows in val_batches:
            feats = context_features(tokens, *rows)[1]
            with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
                logits = draft_logits_train(draft, rotary, embed_w, head_w, feats, tokens, anchors)
                loss += block_loss(logits, tokens, anchors, lengths, settings.gamma)[0]
            prefix += accepted_prefix(logits, tokens, anchors, lengths).sum()
        return 1 + float(prefix) / (n_val * settings.anchors), float(loss) / len(val_batches)

    draft.train()
    batch = next_batch()

    def eager_step(*batch):
        opt.zero_grad(set_to_none=True)
        return loss_and_grads(*batch)

    run_step, graphed = eager_step, False
    if device.type == "cuda" and cuda_graph:
        try:  # the first batch warms up the capture, then trains as the first step below
            run_step, graphed = graphed_step(loss_and_grads, list(draft.parameters()), batch), True
        except RuntimeError as e:  # an op that cannot be captured (a host read in a library's forward)
            log(f"warning: training without a CUDA graph ({str(e).splitlines()[0]})")
            torch.cuda.synchronize()
    bar = tqdm(total=settings.steps, initial=step, desc="training", unit="step", file=sys.stderr)
    first_step, t_steps = step, time.perf_counter()
    while step < settings.steps:
        loss, right = run_step(*batch)
        batch = next_batch()
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, settings)
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update()
        if settings.minutes > 0 and step - first_step in RATE_WINDOW:  # two host waits in the whole run
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step - first_step == RATE_WINDOW[0]:
                t_rate = time.perf_counter()
            else:
                now = time.perf_counter()
                used, rate = now - t0, (RATE_WINDOW[1] - RATE_WINDOW[0]) / (now - t_rate)
                settings.steps = bar.total = steps_in_budget(settings, step, rate, used)
                log(f"time budget {settings.minutes:g} min: {used:.0f} s used by the data and {step} steps, "
                    f"{rate:.2f} steps/s measured: {settings.steps} steps in all")
        if step % 10 == 0 or step == settings.steps:  # .item() waits for the GPU: not every step
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{right.item():.2f}")
        if step % settings.save_every == 0 or step == settings.steps:
            best = True  # without validation: every checkpoint's draft
            if n_val:
                tau, val_loss = validate()
                best = all(tau > c["tau"] for c in checks)
                checks.append(dict(step=step, tau=tau, loss=val_loss))
                write_json(out / "validation.json", dict(sequences=n_val, checks=checks))
                bar.write(f"step {step}: validation tau {tau:.3f}, loss {val_loss:.3f}"
                          + (" (best so far: draft written)" if best else ""), file=sys.stderr)
            atomic_torch_save(dict(draft=draft.state_dict(), optimizer=opt.state_dict(), step=step,
                                   settings=asdict(settings), validation=checks), ckpt_path)
            if best:
                save_dflash(draft, target, out / "draft")
    bar.close()
    steps_s = time.perf_counter() - t_steps
    top = max(checks, key=lambda c: c["tau"]) if checks else None
    kept = f" (step {top['step']}'s, the best validation tau {top['tau']:.3f})" if top else ""
    log(f"trained {settings.steps} steps; {time.perf_counter() - t0:.0f} s in this run, of which the steps "
        f"{steps_s:.0f} s ({(settings.steps - first_step) / max(steps_s, 1e-9):.2f} steps/s, checkpoints "
        f"included); draft{kept}: {out / 'draft'}")
    return TrainResult(out / "draft", settings.steps, first_step, data_reused,
                       bank.storage if bank is not None else "target in every step", graphed,
                       dict(sequences=n_val, checks=checks) if n_val else None, top["step"] if top else None)
