from kvtier.app.cli import main

main()
