from adapt.cli import main

main()
