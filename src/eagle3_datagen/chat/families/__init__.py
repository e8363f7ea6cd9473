"""The target families: one registered entry per family (`base.FAMILIES`), and the model's chat as
the stages use it (`target_chat.load_chat`): tokenizer, family, template switches and special tokens, checked.

A new family is a module here with its `@register`ed `Family` subclass, imported by `target_chat`.
"""
