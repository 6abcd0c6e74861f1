"""The two-layer MLP, batches and flattening that the PyTorch optimizer workers
(momentum_worker.py, compressed_update_worker.py) train and record, and their one-layer
``transformers`` GPT-2."""
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def flat(tensors):
    return torch.cat([t.detach().reshape(-1).double() for t in tensors]).numpy()


def tiny_gpt2():
    """A one-layer GPT-2 of 32 wide, vocabulary 64, the same weights on every rank."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1,
                                      n_head=2, bos_token_id=0, eos_token_id=0))
