"""torchvision's ResNet-50, random weights, batch 1."""
import torch
import torchvision

torch.manual_seed(0)
IMPLEMENTATION = f"torchvision {torchvision.__version__} resnet50(weights=None)"
model = torchvision.models.resnet50(weights=None).eval().to(torch.float32)
example_inputs = (torch.randn(1, 3, 224, 224).to(torch.float32),)
