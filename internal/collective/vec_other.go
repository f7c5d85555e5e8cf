//go:build !amd64

package collective

// hasVec and hasF16 are false: the vector kernels have only an amd64
// implementation.
const (
	hasVec = false
	hasF16 = false
)

func addF32Vec(d, s []float32) { panic("collective: no vector kernel on this architecture") }

func divF32Vec(d []float32, div float32) { panic("collective: no vector kernel on this architecture") }

func scaleF32Vec(d []float32, f float32) { panic("collective: no vector kernel on this architecture") }

func addBF16Vec(d, s []uint16) { panic("collective: no vector kernel on this architecture") }

func addF16Vec(d, s []uint16) { panic("collective: no vector kernel on this architecture") }

func addF64Vec(d, s []float64) { panic("collective: no vector kernel on this architecture") }
