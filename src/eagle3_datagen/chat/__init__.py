"""The target model's chat side: its tokenizer and chat template, and tool-call markup."""
