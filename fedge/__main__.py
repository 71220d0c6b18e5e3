from fedge.cli import main

main()
