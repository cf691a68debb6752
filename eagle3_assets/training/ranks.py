"""This process's place in a training job: rank and world size under torch.distributed (torchrun), else 0 of 1."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ranks:
    """This process's place in the training job (rank 0 of 1 without torch.distributed)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def current(cls) -> Ranks:
        # lazy: loads torch (heavy), which only this path needs
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def barrier(self) -> None:
        if self.world > 1:
            # lazy: loads torch (heavy), which only this path needs
            import torch.distributed as dist

            dist.barrier()

    def all_reduce(self, value: float, op: str = "sum") -> float:
        """``value`` summed (or min-ed) over the ranks; itself in a single process."""
        if self.world == 1:
            return value
        # lazy: loads torch (heavy), which only this path needs
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MIN)
        return float(tensor.item())
