"""The two-layer MLP, batches and flattening that the PyTorch optimizer workers
(momentum_worker.py, compressed_update_worker.py) train and record."""
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
