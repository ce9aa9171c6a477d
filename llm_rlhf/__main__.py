from llm_rlhf.interfaces.cli import entry

entry()
