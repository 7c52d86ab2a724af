"""The cuBLAS workspace choice the engine builder makes before its first matmul."""

from __future__ import annotations

import os

import torch

from ninfer.engine.gemm_setup import NO_WORKSPACE, prefer_matmuls_without_workspace


def test_cuda_engines_turn_the_workspace_off(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    prefer_matmuls_without_workspace(torch.device("cuda", 0))  # only reads the device type

    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == NO_WORKSPACE
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "0"


def test_a_users_setting_and_cpu_runs_are_left_alone(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    prefer_matmuls_without_workspace(torch.device("cuda", 0))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    prefer_matmuls_without_workspace(torch.device("cpu"))
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
