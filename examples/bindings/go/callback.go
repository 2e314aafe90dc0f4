package tandem

/*
#include <stdint.h>
#include <stddef.h>
*/
import "C"

import (
	"runtime/cgo"
	"unsafe"
)

// pieceSink receives the pieces of one generate call (user_data is its cgo.Handle).
type pieceSink struct {
	onPiece func(piece string, token int32) bool
	text    []byte
	panic   interface{}
}

//export goTandemPiece
func goTandemPiece(piece *C.char, n C.size_t, token C.int32_t, userData unsafe.Pointer) C.int {
	sink := cgo.Handle(uintptr(userData)).Value().(*pieceSink)
	text := C.GoStringN(piece, C.int(n))
	sink.text = append(sink.text, text...)
	stop := false
	func() {
		// A panic must not unwind through C: record it, stop, re-panic after the call.
		defer func() {
			if r := recover(); r != nil {
				sink.panic = r
				stop = true
			}
		}()
		if sink.onPiece != nil {
			stop = sink.onPiece(text, int32(token))
		}
	}()
	if stop {
		return 1
	}
	return 0
}
