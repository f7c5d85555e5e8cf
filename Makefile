# gdrlink: the two commands are `make run` and `make test`.
GO      ?= go
# Packages whose tests run under the race detector (all of them).
PKGS    ?= ./...

.PHONY: run test vet unit benchonce bench test-rdma fuzz fault-matrix gpu-check

## run: the main job on the embedded default (no RDMA NIC, no GPU needed).
run:
	$(GO) run ./examples/exchange

## test: vet, race-detected tests, and every benchmark once so none rots.
test: vet unit benchonce

vet:
	$(GO) vet $(PKGS)
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

unit:
	$(GO) test -race -count=1 -timeout 20m $(PKGS)

benchonce:
	$(GO) test -run '^$$' -bench . -benchtime=1x -count=1 -timeout 20m $(PKGS)

## bench: the benchmark program's scenarios, tables and SVG plots under bench/out.
bench:
	mkdir -p bench/out
	$(GO) run ./bench -scenario all -svg bench/out

## test-rdma: the ibverbs tests on a real verbs stack (Soft-RoCE in a qemu guest).
test-rdma:
	./scripts/test-rdma.sh

## fault-matrix: the tensor stream under faults between two network
## namespaces (root only; skips otherwise).
fault-matrix:
	./scripts/fault-matrix.sh

## fuzz: each fuzz target for a short while.
fuzz:
	./scripts/fuzz.sh

## gpu-check: build the GPU test binaries, gdrcheck and bench into gpu-check/;
## copy that directory to a GPU node and run gpu-check/gpu-check.sh run gpu-check.
gpu-check:
	GO=$(GO) ./scripts/gpu-check.sh build gpu-check
