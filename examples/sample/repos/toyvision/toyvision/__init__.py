"""A toy backbone library."""


class Backbone:
    def __init__(self, arch: str, width: int = 16) -> None:
        if arch not in ("resnet18", "vgg11", "mobilenet"):
            raise ValueError(f"unknown architecture {arch}")
        self.arch, self.width = arch, width

    def summary(self) -> str:
        return f"{self.arch} width={self.width}"


def load_backbone(arch: str, width: int = 16) -> Backbone:
    return Backbone(arch, width)
