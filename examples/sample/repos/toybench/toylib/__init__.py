"""A toy model library."""


class ToyModel:
    def __init__(self, kind: str, hidden: int = 16, layers: int = 2) -> None:
        if kind not in ("gcn", "gat", "mlp"):
            raise ValueError(f"unknown model {kind}")
        self.kind, self.hidden, self.layers = kind, hidden, layers

    def describe(self) -> str:
        return f"{self.kind} hidden={self.hidden} layers={self.layers}"


def build_model(kind: str, hidden: int = 16, layers: int = 2) -> ToyModel:
    return ToyModel(kind, hidden, layers)
