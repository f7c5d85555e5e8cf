# gdrlink: the two commands are `make run` and `make test`.
GO      ?= go
# Packages whose tests run under the race detector (all of them).
PKGS    ?= ./...
# Nested modules (their own go.mod, so the core module does not depend on
# what they import); vet and unit run in each of them too.
NESTED  ?= contrib/gorgonia examples/ddp

.PHONY: run test vet unit nested benchonce bench test-rdma fuzz fault-matrix gpu-check

## run: the main job on the embedded default (no RDMA NIC, no GPU needed).
run:
	$(GO) run ./examples/exchange

## test: vet, race-detected tests, and every benchmark once so none rots.
test: vet unit benchonce

vet:
	$(GO) vet $(PKGS)
	@for m in $(NESTED); do echo "go vet in $$m"; (cd $$m && $(GO) vet ./...) || exit 1; done
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

unit:
	$(GO) test -race -count=1 -timeout 20m $(PKGS)
	@for m in $(NESTED); do echo "go test in $$m"; (cd $$m && $(GO) test -race -count=1 -timeout 10m ./...) || exit 1; done

## nested: vet and race-detected tests of the nested modules alone.
nested:
	@for m in $(NESTED); do echo "go vet && go test -race in $$m"; (cd $$m && $(GO) vet ./... && $(GO) test -race -count=1 -timeout 10m ./...) || exit 1; done

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
