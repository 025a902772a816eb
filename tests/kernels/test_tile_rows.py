"""Rows per program of the row-copy kernel: the tile size, then smaller tiles for small launches."""

from __future__ import annotations

import pytest

from kvpool.kernels import triton_ops


def test_without_a_program_floor_the_tile_size_alone_decides() -> None:
    # 576 B latent = 144 int32 words -> 256-word rows -> 4096 / 256 = 16 rows per program
    assert triton_ops.tile_rows(144, 5120, 1, 132, 0) == 16
    assert triton_ops.tile_rows(36, 1792, 1, 132, 0) == 64  # 144 B indexer: 64-word rows
    assert triton_ops.tile_rows(144, 5, 1, 132, 0) == 8  # never more rows than the launch has


def test_a_small_launch_shrinks_its_tiles_until_every_multiprocessor_has_programs() -> None:
    # one 256-token chunk of 20 latent layers: 5,120 rows; 320 programs of 16 rows < 4 x 132
    assert triton_ops.tile_rows(144, 5120, 1, 132, 4) == 8  # 640 programs
    assert triton_ops.tile_rows(144, 5120, 1, 132, 16) == 2  # floor: MIN_TILE_ROWS
    # a 64-chunk window (64 groups) already has enough programs: unchanged
    assert triton_ops.tile_rows(144, 5120, 64, 132, 16) == 16


@pytest.mark.parametrize("floor", [0, 4, 16])
def test_rows_are_a_power_of_two_within_bounds(floor: int) -> None:
    for rec in (1, 36, 144, 288):
        for grid_rows in (1, 7, 256, 5120, 40960):
            r = triton_ops.tile_rows(rec, grid_rows, 1, 132, floor)
            assert r >= 1 and r & (r - 1) == 0
            assert r <= max(1, triton_ops.TILE_WORDS // (1 << (rec - 1).bit_length()))
