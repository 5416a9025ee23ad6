"""A data position for the Checkpointer's ``data=``: samples consumed so far,
which a restore must bring back (the memory tier's tests)."""


class Position:
    def __init__(self):
        self.samples = 0

    def state_dict(self):
        return {"samples": self.samples}

    def load_state_dict(self, state):
        self.samples = state["samples"]
