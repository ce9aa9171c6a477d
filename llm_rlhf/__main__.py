from llm_rlhf.cli import entry

entry()
