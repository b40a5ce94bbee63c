from kvserve.cli import main

main()
