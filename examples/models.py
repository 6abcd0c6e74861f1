"""Small CIFAR-sized (3x32x32) models for benchmarks: a VGG-like and a ResNet-like net, and
a 6.4M-parameter CNN+MLP whose size is one large fully-connected layer; and the MNIST
examples' small CNN (MnistNet)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MnistNet(nn.Module):
    """The MNIST examples' CNN (1x28x28 -> 10): two 5x5 convolutions, two linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def vgg_small(num_classes=10):
    """Six 3x3 convolutions (32-32-64-64-128-128) in three pooled stages, two linear layers."""
    layers, c_in = [], 3
    for c_out in (32, 32, "M", 64, 64, "M", 128, 128, "M"):
        if c_out == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
            c_in = c_out
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * 4 * 4, 256), nn.ReLU(),
                         nn.Linear(256, num_classes))


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetSmall(nn.Module):
    """ResNet-like: a stem and three stages of two basic blocks (32, 64, 128 channels)."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32),
                                  nn.ReLU())
        blocks, c_in = [], 32
        for c_out, stride in ((32, 1), (64, 2), (128, 2)):
            blocks += [BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class CNNMLPLarge(nn.Module):
    """A 6.4M-parameter model dominated by one fully-connected layer (like VGG's or
    AlexNet's classifier): two convolutions on 3x32x32 input, then 4096 -> 1536 -> 10."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 1536)
        self.fc2 = nn.Linear(1536, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))
