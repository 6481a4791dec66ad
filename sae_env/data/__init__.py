"""Paths of the real traces embedded in the package (see README.md in this folder for provenance)."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent

MOONCAKE_ARXIV = DATA_DIR / "mooncake" / "arxiv_trace_first1000.jsonl.gz"
MOONCAKE_SYNTHETIC = DATA_DIR / "mooncake" / "synthetic_trace.jsonl.gz"
BAILIAN = DATA_DIR / "qwen_bailian" / "traceA_excerpt_22rows.jsonl.gz"
TAUBENCH = DATA_DIR / "tau_bench" / "airline_gpt4o_trajectories.json.gz"
TAUBENCH_TOOLS = DATA_DIR / "tau_bench" / "airline_tools_schema.json.gz"
WILDCHAT = DATA_DIR / "wildchat" / "wildchat_multiturn.jsonl.gz"
GSM8K = DATA_DIR / "gsm8k" / "gsm8k_test.jsonl.gz"
GSM8K_EXEMPLARS = DATA_DIR / "gsm8k" / "cot_exemplars.json"
WORKLOADS_DIR = DATA_DIR / "workloads"  # real heterogeneous mixes of the traces above (mix config files)
AZURE_CONV = DATA_DIR / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv.gz"
AZURE_CODE = DATA_DIR / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv.gz"

ALL = {
    "mooncake_arxiv": (MOONCAKE_ARXIV, "mooncake"),
    "mooncake_synthetic": (MOONCAKE_SYNTHETIC, "mooncake"),
    "bailian": (BAILIAN, "bailian"),
    "taubench": (TAUBENCH, "taubench"),
    "wildchat": (WILDCHAT, "conversations"),
    "gsm8k": (GSM8K, "gsm8k"),
    "azure_conv": (AZURE_CONV, "azure"),
    "azure_code": (AZURE_CODE, "azure"),
    # Real heterogeneous workloads: recorded sessions of the traces above on Azure's arrival process.
    "real_chat": (WORKLOADS_DIR / "real_chat.yaml", "mix"),
    "real_agent": (WORKLOADS_DIR / "real_agent.yaml", "mix"),
    "real_templated": (WORKLOADS_DIR / "real_templated.yaml", "mix"),
    "real_shift": (WORKLOADS_DIR / "real_shift.yaml", "mix"),
}
