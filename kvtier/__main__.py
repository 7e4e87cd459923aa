from kvtier.cli import main

main()
