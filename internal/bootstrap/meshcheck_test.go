package bootstrap_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
)

// buildMeshcheck builds the launcher check program into a temporary
// directory.
func buildMeshcheck(t *testing.T) string {
	t.Helper()
	gobin := filepath.Join(runtime.GOROOT(), "bin", "go")
	out := filepath.Join(t.TempDir(), "meshcheck")
	cmd := exec.Command(gobin, "build", "-o", out, "./internal/meshcheck")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building meshcheck: %v\n%s", err, b)
	}
	return out
}

// freeAddr returns a loopback address with a port free at the time of the
// call, for the root of a job whose processes start later.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// cleanEnv is this process's environment without the variables that say
// which rank a process is and which job key it holds, so a test's own
// launch decides.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case strings.HasPrefix(k, "OMPI_"), strings.HasPrefix(k, "SLURM_"), strings.HasPrefix(k, "PMIX_"):
			continue
		}
		switch k {
		case "GDRLINK_RANK", "GDRLINK_SIZE", "GDRLINK_ROOT", "GDRLINK_PEERS", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
			jobauth.KeyEnv, jobauth.KeyFileEnv, jobauth.InsecureEnv:
			continue
		}
		env = append(env, kv)
	}
	return env
}

// TestMeshUnderMpirun starts four ranks with Open MPI's mpirun: they find
// each other from OMPI_COMM_WORLD_RANK/SIZE and GDRLINK_ROOT, connect every
// pair over the tcp provider and check each other's writes.
func TestMeshUnderMpirun(t *testing.T) {
	mpirun, err := exec.LookPath("mpirun")
	if err != nil {
		t.Skip("mpirun is not installed (Debian package openmpi-bin)")
	}
	prog := buildMeshcheck(t)
	root := freeAddr(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4",
		"-x", "GDRLINK_ROOT="+root, prog, "-timeout", "90s")
	// plm=isolated: launch on this node without an ssh or rsh agent, which
	// a container (or an install without recommends) may lack.
	cmd.Env = append(cleanEnv(), "OMPI_MCA_plm=isolated")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("mpirun: %v\n%s", err, out)
	}
	for r := 0; r < 4; r++ {
		if want := fmt.Sprintf("rank %d of 4: 3 peers wrote", r); !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

// TestMeshByHand starts the same program four times with the variables
// torchrun sets, and a job key (GDRLINK_JOB_KEY) as the front door hands
// it to the processes it spawns.
func TestMeshByHand(t *testing.T) {
	prog := buildMeshcheck(t)
	_, secret, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	host, port, _ := net.SplitHostPort(freeAddr(t))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	outs := make([][]byte, 4)
	errs := make([]error, 4)
	for r := 0; r < 4; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cmd := exec.CommandContext(ctx, prog, "-timeout", "90s")
			cmd.Env = append(cleanEnv(), fmt.Sprintf("RANK=%d", r), "WORLD_SIZE=4", "MASTER_ADDR="+host, "MASTER_PORT="+port, jobauth.KeyEnv+"="+secret)
			outs[r], errs[r] = cmd.CombinedOutput()
		}()
	}
	wg.Wait()
	for r := range outs {
		if errs[r] != nil {
			t.Errorf("rank %d: %v\n%s", r, errs[r], outs[r])
		} else if !strings.Contains(string(outs[r]), fmt.Sprintf("rank %d of 4", r)) {
			t.Errorf("rank %d output: %s", r, outs[r])
		}
	}
}
