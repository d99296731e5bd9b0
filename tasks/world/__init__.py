"""The built-in synthetic world, one provider of route specs: its domains and verifiers (domains), its config (config),
tokenizer (tokenizer), datasets (data) and the spec it writes (spec). Above specs."""
