import torch

class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dw = torch.nn.Conv2d(3, 6, 3, padding=1, groups=3, bias=False)
        self.bn = torch.nn.BatchNorm2d(6)
        self.group = torch.nn.Conv2d(6, 8, 3, padding=1, groups=2)
        self.pool, self.avg = torch.nn.MaxPool2d(3, 2, 1), torch.nn.AvgPool2d(2, 2)
        self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avg(self.pool(torch.relu(self.group(torch.relu(self.bn(self.dw(x)))))))
        t = x.flatten(2).transpose(1, 2)
        q = self.q(t).reshape(1, 4, 2, 4).transpose(1, 2)
        k = self.k(t).reshape(1, 4, 2, 4).transpose(1, 2)
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1)

torch.manual_seed(0)
model = Net().eval()
example_inputs = (torch.randn(1, 3, 8, 8),)
