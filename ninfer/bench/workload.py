"""Random request shapes, as nano-vllm's benchmark draws them."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(num: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                    seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*input_range))] for _ in range(num)]
    outs = [rng.randint(*output_range) for _ in range(num)]
    return Workload(prompts, outs)


def fixed_workload(num: int, input_len: int, output_len: int, vocab: int, seed: int = 0) -> Workload:
    return random_workload(num, (input_len, input_len), (output_len, output_len), vocab, seed)
