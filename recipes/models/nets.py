"""Networks of the recipes: torchvision's ResNets (randomly initialized) and a tiny CNN for digits."""

from __future__ import annotations

from torch import nn
from torchvision.models import resnet18


def digits_cnn(num_classes: int = 10, width: int = 32) -> nn.Module:
    """Two 3x3 conv blocks and a linear head for 1 x 8 x 8 images (about 30k parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(),
        nn.Linear(2 * width * 16, num_classes),
    )


def cifar_resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision ResNet-18 with the CIFAR stem: a 3x3 stride-1 first conv and no max-pool.

    32x32 inputs then keep 32x32 resolution through the first stage, as in the paper's code.
    """
    net = resnet18(weights=None, num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net
