module tandem.example/tandem

go 1.19
