"""The text and the model of examples/ddp_gpt2.py, benchmarks/time_to_loss.py and
benchmarks/adam_update_sim.py: Python's reference documentation as bytes
(``pydoc_data.topics``, what ``help()`` prints, in every CPython: 465 KB of English prose
and code examples, so nothing is downloaded) and a small GPT-2 (Hugging Face
``transformers``, random init, byte vocabulary)."""
import torch


def corpus():
    """The text as a uint8 tensor: (train, validation)."""
    import pydoc_data.topics as topics
    data = "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode()
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(0.9 * t.numel())
    return t[:cut], t[cut:]


def windows(text, starts, seq):
    return torch.stack([text[s:s + seq + 1] for s in starts.tolist()])


def train_batch(train, step, rank, batch, seq, seed=0):
    """Rank ``rank``'s batch at ``step``: ``batch`` windows of ``seq + 1`` bytes, drawn from
    a generator seeded by (step, rank, seed), so every method sees the same batches."""
    g = torch.Generator().manual_seed(100003 * step + rank + 7919 * 1000003 * seed)
    return windows(train, torch.randint(0, train.numel() - seq - 1, (batch,), generator=g), seq)


def make_model(args, seed=0):
    """The GPT-2 of ``args`` (width, layers, seq).  ``seed=0``: the initial weights every
    recorded run used; another seed draws the matrices anew from GPT-2's N(0, 0.02)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.width,
                        n_layer=args.layers, n_head=4, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    if seed:
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.02)
    return model


def validation_loss(model, batch):
    """The model's loss on ``batch`` (windows of seq + 1 bytes) in eval mode, without
    gradients; the model is back in train mode afterwards."""
    model.eval()
    with torch.no_grad():
        loss = float(model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss)
    model.train()
    return loss


def method_lr(method, default):
    """``(method, learning rate)`` of a benchmark's method label ``METHOD[@LR]``
    (benchmarks/time_to_loss.py and its worker); ValueError for a bad ``LR``."""
    method, at, lr = method.partition("@")
    try:
        return method, float(lr) if at else default
    except ValueError:
        raise ValueError(f"{method}@{lr}: the learning rate after '@' must be a number "
                         "('cu:topk:density=0.01@2e-3')") from None
