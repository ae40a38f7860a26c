"""Tiny saved encoders (BERT-like, ESM-like) and a DNA table for the task tests (nothing downloaded)."""

from __future__ import annotations

import pytest

from tiny_encoders import dna_rows, save_encoder, write_csv


@pytest.fixture(scope="session")
def encoder_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {family: save_encoder(root / family, family) for family in ("bert", "esm")}


@pytest.fixture(scope="session")
def dna_csv(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("dna") / "train.csv", dna_rows(24))
