"""Drafts from a GRPO group's text: plain Python, no vLLM.

`suffix_index` finds, in the text a group has already produced (its running siblings and
earlier rollouts), what followed the current context; `drafter` chooses, each step and per
request, between those drafts and the model draft's. What hooks them into vLLM's model
runner is a patch like the others (`patches/features/group_drafts_v0_32.py`), since it
changes vLLM where vLLM has no extension point.
"""
