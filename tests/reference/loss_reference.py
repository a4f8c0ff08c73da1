"""The independent PyTorch oracle for Keel's training losses.

Written from `shared/keel-training/LOSSES.md` (the text the Rust losses in
`shared/keel-training/src/loss/` also follow), in float64 with autograd. Reads a JSON list of
problems on stdin (each: the loss config, [B][S] logprob tables, masks, advantages or scores)
and prints a list of `{"loss", "grad", "metrics"}`; `grad` is d loss / d logprobs ([B][S]),
or d loss / d scores for bradley_terry. `shared/keel-training/tests/losses.rs` compares Keel
with it.
"""

import json
import math
import sys

import torch

EPS = 1e-8

PG_DEFAULTS = {
    "ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "ratio_clip_c": None,
    "reference_policy_kl_penalty": 0.01, "use_kl_in_reward": False, "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0, "kl_output_clamp_value": 10.0,
    "use_importance_sampling_correction": False, "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio_min": None, "truncated_importance_sampling_ratio_max": None,
    "token_level_loss": True, "sequence_level_importance_ratios": False,
    "disable_ppo_ratio": False, "force_on_policy_ratio": False, "cispo": False,
}
DPO_DEFAULTS = {
    "reference_policy_kl_penalty": 0.05, "preference_average_log_probs": False,
    "sft_loss_weight": 0.0, "sft_average_log_probs": False, "preference_loss_weight": 1.0,
}


def fail(message):
    print(f"loss_reference: {message}", file=sys.stderr)
    sys.exit(1)


def table(data, key, required=True):
    if key not in data or data[key] is None:
        if required:
            fail(f"missing `{key}`")
        return None
    return torch.tensor(data[key], dtype=torch.float64)


def seq_mean(x, mask):
    return (x * mask).sum(1, keepdim=True) / (mask.sum(1, keepdim=True) + EPS)


def masked_mean(x, mask, n):
    return (x * mask).sum() / (n + EPS)


def clipped_pg(cfg, data, lp_full, mask, sample_mask):
    lp = lp_full[:, 1:]
    prev_t = table(data, "prev_logprobs", False)
    prev = prev_t[:, 1:] if prev_t is not None else lp.detach()
    gen_t = table(data, "generation_logprobs", False)
    gen = gen_t[:, 1:] if gen_t is not None else prev
    adv_t = table(data, "advantages")
    adv = adv_t[:, 1:] if adv_t.dim() == 2 else adv_t[:, None]
    n_tok, n_seq = mask.sum().item(), sample_mask.sum().item()

    if cfg["force_on_policy_ratio"]:
        log_ratio = lp - lp.detach()
    elif cfg["sequence_level_importance_ratios"]:
        log_ratio = seq_mean(lp - prev, mask).expand_as(lp)
    else:
        log_ratio = lp - prev
    r = torch.exp(lp - prev) if cfg["disable_ppo_ratio"] else torch.exp(log_ratio)
    r_c = r.clamp(1 - cfg["ratio_clip_min"], 1 + cfg["ratio_clip_max"])
    if cfg["disable_ppo_ratio"]:
        per_token = -adv * lp
    elif cfg["cispo"]:
        # CISPO: the clipped ratio is a constant weight on each token's policy gradient.
        per_token = -adv * r_c.detach() * lp
    else:
        per_token = torch.maximum(-adv * r, -adv * r_c)
        if cfg["ratio_clip_c"] is not None:
            capped = torch.minimum(per_token, (-adv * cfg["ratio_clip_c"]).expand_as(per_token))
            per_token = torch.where((adv < 0).expand_as(per_token), capped, per_token)

    with torch.no_grad():
        if cfg["use_importance_sampling_correction"]:
            w = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
            lo = cfg["truncated_importance_sampling_ratio_min"]
            hi = cfg["truncated_importance_sampling_ratio_max"]
            kind = cfg["truncated_importance_sampling_type"]
            lo = 0.0 if lo is None else lo
            hi = math.inf if hi is None else hi
            if kind == "tis":
                w = w.clamp(lo, hi)
            elif kind == "icepop":
                w = torch.where((w >= lo) & (w <= hi), w, torch.zeros_like(w))
            elif kind == "seq-mask-tis":
                s = torch.exp(seq_mean(prev - gen, mask))
                w = w * ((s >= lo) & (s <= hi)).double()
            elif kind is not None:
                fail(f"unknown truncation type {kind}")
        else:
            w = torch.ones_like(lp)

    def reduce(x):
        if cfg["token_level_loss"]:
            return masked_mean(x, mask, n_tok)
        return (seq_mean(x, mask).squeeze(1) * sample_mask).sum() / (n_seq + EPS)

    actor = reduce(w * per_token)
    beta = 0.0 if cfg["use_kl_in_reward"] else cfg["reference_policy_kl_penalty"]
    if beta != 0:
        ref = table(data, "reference_logprobs")[:, 1:]
        logr = ref - lp
        if cfg["kl_input_clamp_value"] is not None:
            c = cfg["kl_input_clamp_value"]
            logr = logr.clamp(-c, c)
        kind = cfg["reference_policy_kl_type"]
        if kind == "k1":
            k = -logr
        elif kind == "k2":
            k = logr ** 2 / 2
        elif kind == "k3":
            k = torch.exp(logr) - 1 - logr
        else:
            fail(f"unknown KL type {kind}")
        kl_tok = k * torch.exp(lp - lp.detach())
        if cfg["kl_output_clamp_value"] is not None:
            c = cfg["kl_output_clamp_value"]
            kl_tok = kl_tok.clamp(-c, c)
        kl = reduce(kl_tok)
    else:
        kl = torch.zeros((), dtype=torch.float64)
    loss = actor + beta * kl

    with torch.no_grad():
        valid = mask > 0

        def mean(x):
            return masked_mean(x, mask, n_tok).item()

        metrics = {
            "loss": loss.item(), "actor_loss": actor.item(), "kl_penalty": beta * kl.item(),
            "probs_ratio": mean(r), "probs_ratio_clamped": mean(r_c),
            "probs_ratio_min": r[valid].min().item(), "probs_ratio_max": r[valid].max().item(),
            "probs_ratio_clamped_min": r_c[valid].min().item(), "probs_ratio_clamped_max": r_c[valid].max().item(),
            "token_mult_prob_error": mean(torch.exp((gen - prev).abs())),
            "gen_kl_error": mean(torch.exp(prev - gen) - 1 - (prev - gen)),
            "policy_kl_error": mean(torch.exp(prev - gen) * (torch.exp(gen - prev) - 1 - (gen - prev))),
            "approx_entropy": -mean(torch.exp(lp - gen) * lp),
            "sampling_importance_ratio": mean(w),
            "num_valid_samples": n_seq,
        }
    return loss, metrics


def pair_mask_of(sample_mask):
    return sample_mask[0::2] * sample_mask[1::2]


def dpo(cfg, data, lp_full, mask, sample_mask):
    lp = lp_full[:, 1:]
    ref = table(data, "reference_logprobs")[:, 1:]
    beta = cfg["reference_policy_kl_penalty"]
    d = lp - ref
    r = seq_mean(d, mask).squeeze(1) if cfg["preference_average_log_probs"] else (d * mask).sum(1)
    pm = pair_mask_of(sample_mask)
    n_pair = pm.sum().item()
    rc, rr = r[0::2], r[1::2]
    pref = (pm * -torch.nn.functional.logsigmoid(beta * (rc - rr))).sum() / (n_pair + EPS)
    nll = (-lp[0::2] * mask[0::2]).sum(1)
    if cfg["sft_average_log_probs"]:
        nll = nll / mask[0::2].sum(1).clamp(min=1)
    sft = (pm * nll).sum() / (n_pair + EPS)
    loss = cfg["preference_loss_weight"] * pref + cfg["sft_loss_weight"] * sft
    with torch.no_grad():
        metrics = {
            "loss": loss.item(), "preference_loss": pref.item(), "sft_loss": sft.item(),
            "accuracy": ((rc > rr).double() * pm).sum().item() / (n_pair + EPS),
            "rewards_chosen_mean": (beta * rc * pm).sum().item() / (n_pair + EPS),
            "rewards_rejected_mean": (beta * rr * pm).sum().item() / (n_pair + EPS),
            "rewards_margin_mean": (beta * (rc - rr) * pm).sum().item() / (n_pair + EPS),
            "num_valid_samples": n_pair,
        }
    return loss, metrics


def bradley_terry(scores, sample_mask):
    pm = pair_mask_of(sample_mask)
    n_pair = pm.sum().item()
    sc, sr = scores[0::2], scores[1::2]
    loss = (pm * -torch.nn.functional.logsigmoid(sc - sr)).sum() / (n_pair + EPS)
    with torch.no_grad():
        metrics = {
            "loss": loss.item(),
            "accuracy": ((sc > sr).double() * pm).sum().item() / (n_pair + EPS),
            "chosen_score_mean": (sc * pm).sum().item() / (n_pair + EPS),
            "rejected_score_mean": (sr * pm).sum().item() / (n_pair + EPS),
            "score_margin": ((sc - sr) * pm).sum().item() / (n_pair + EPS),
            "num_valid_samples": n_pair,
        }
    return loss, metrics


def value_loss(cfg, data, values, mask):
    old = table(data, "old_values")[:, 1:]
    returns = table(data, "returns")[:, 1:]
    n_tok = mask.sum().item()
    v = values[:, 1:]
    squared = (v - returns) ** 2
    metrics = {}
    clip = cfg.get("value_clip")
    if clip is not None:
        bounded = old + torch.clamp(v - old, min=-clip, max=clip)
        bounded_squared = (bounded - returns) ** 2
        metrics["value_clip_fraction"] = masked_mean((bounded_squared > squared).double(), mask, n_tok).item()
        squared = torch.maximum(squared, bounded_squared)
    loss = masked_mean(squared, mask, n_tok) / 2
    metrics["value_loss"] = loss.item()
    metrics["values_mean"] = masked_mean(v.detach(), mask, n_tok).item()
    metrics["returns_mean"] = masked_mean(returns, mask, n_tok).item()
    return loss, metrics


def solve(data):
    config = dict(data.get("loss") or fail("missing `loss`"))
    kind = config.pop("type", None)
    token_mask = table(data, "token_mask")
    rows = token_mask.shape[0]
    sample_mask = table(data, "sample_mask", False)
    sample_mask = torch.ones(rows, dtype=torch.float64) if sample_mask is None else sample_mask
    mask = token_mask[:, 1:] * sample_mask[:, None]

    if kind == "value":
        wrt = table(data, "values").requires_grad_(True)
        loss, metrics = value_loss(config, data, wrt, mask)
    elif kind == "bradley_terry":
        wrt = table(data, "scores").requires_grad_(True)
        loss, metrics = bradley_terry(wrt, sample_mask)
    else:
        wrt = table(data, "logprobs").requires_grad_(True)
        if kind == "clipped_pg":
            loss, metrics = clipped_pg({**PG_DEFAULTS, **config}, data, wrt, mask, sample_mask)
        elif kind == "nll":
            n_tok = mask.sum().item()
            loss = masked_mean(-wrt[:, 1:], mask, n_tok)
            metrics = {"loss": loss.item(), "num_unmasked_tokens": n_tok, "num_valid_samples": sample_mask.sum().item()}
        elif kind == "dpo":
            loss, metrics = dpo({**DPO_DEFAULTS, **config}, data, wrt, mask, sample_mask)
        else:
            fail(f"unknown loss type {kind!r}")
    loss.backward()
    return {"loss": loss.item(), "grad": wrt.grad.tolist(), "metrics": metrics}


def main():
    problems = json.load(sys.stdin)
    if not isinstance(problems, list):
        fail("expected a JSON list of problems")
    print(json.dumps([solve(p) for p in problems]))


if __name__ == "__main__":
    main()
