"""``auto``'s decision as a user reads it: the table rank 0 logs after each decision
(per bucket, each candidate's compress + communicate + decompress ms; the predicted step
of auto's choice and of each candidate alone; what the trial measured), and the same
figures as a dict (``Auto.decisions``, ``opt.stats``).

Imports: the standard library and :mod:`.model`.
"""
from .model import predict


def summary(auto, compute, why=""):
    """The current decision: predicted step seconds of auto's choice and of each
    candidate alone, the link fit, and a printable ``table``."""
    costs = auto.costs
    n = len(auto.members)
    choice = [auto.choice.get(b.key, 0) for b in costs]
    alone = [predict(costs, [c] * len(costs), compute, auto.scale) for c in range(n)]
    mixed = predict(costs, choice, compute, auto.scale)
    alpha, beta = auto.link
    names = auto.names
    lines = [f"hvd_compress auto at step {auto.steps} ({why}): link alpha "
             f"{1e3 * alpha:.2f} ms, beta {beta / 1e6:.1f} MB/s, scale {auto.scale:.2f}; "
             "per bucket: compress+communicate+decompress ms of each candidate",
             "  " + " | ".join(["bucket", "ready ms"] + [f"[{i}] {s}" for i, s in enumerate(names)]
                               + ["chosen"])]
    for b, c in zip(costs, choice):
        cells = [f"{1e3 * b.compress[i]:.1f}+{1e3 * b.comm[i]:.1f}+{1e3 * b.decompress[i]:.1f}"
                 for i in range(n)]
        key = b.key if len(b.key) <= 32 else b.key[:29] + "..."
        lines.append("  " + " | ".join([key, f"{1e3 * b.ready:.1f}"] + cells + [f"[{c}]"]))
    lines.append("  predicted step ms: auto " + f"{1e3 * mixed:.1f}; "
                 + "; ".join(f"[{i}] alone {1e3 * p:.1f}" for i, p in enumerate(alone)))
    tried = []
    for t, option in enumerate(auto.trials if auto.measured else []):
        per = [option.get(b.key, 0) for b in costs]
        label = f"[{per[0]}] alone" if len(set(per)) == 1 else \
            "mix " + "".join(str(c) for c in per)
        tried.append(dict(option=label, predicted_s=predict(costs, per, compute, auto.scale),
                          measured_s=auto.measured[t]))
    if tried:
        lines.append("  tried for " + f"{auto.trial} steps each (ms, predicted / measured): "
                     + "; ".join(f"{d['option']} {1e3 * d['predicted_s']:.1f} / "
                                 f"{1e3 * d['measured_s']:.1f}" for d in tried)
                     + " -> " + ("mix " + "".join(str(c) for c in choice)
                                 if len(set(choice)) > 1 else f"[{choice[0]}] alone"
                                 if choice else "-"))
    return {"step": auto.steps, "why": why, "choice": {b.key: names[c] for b, c in zip(costs, choice)},
            "predicted_s": mixed, "alone_s": dict(zip(names, alone)), "tried": tried,
            "alpha_s": alpha, "beta_Bps": beta, "scale": auto.scale, "table": "\n".join(lines)}
