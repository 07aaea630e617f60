from grpo_specdec.cli import main

main()
