from pgflow.cli import main

main()
